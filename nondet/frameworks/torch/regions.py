"""A compiled region recorded as one op (``torch.compile``; see compiled.py for how regions
are found and why their ops are not seen one by one).

A call of a compiled graph is one record: the fingerprints of its tensor inputs (parameters
included) before it runs, and of its outputs and the inputs it wrote after; number inputs
(dynamic sizes) are its scalars. Its compiled backward node is hooked to make one more
record, ``<name> (backward)``, from the gradients that reach it to the gradients it returns.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any, Protocol

import torch

from nondet.frameworks.base import RecorderHost
from nondet.frameworks.fp import Fp
from nondet.frameworks.torch import cuda, nocompile
from nondet.records import Flag, Kind, Phase


class CompileHost(RecorderHost, Protocol):
    """What region recording asks of the torch backend (it never imports the backend)."""

    paused: bool
    recorder: Any  # ops.OpRecorder (ops imports compiled, which imports this
    # module: typed loosely to stay acyclic)

    def node_origin(self, node: Any) -> tuple[int, int]: ...

    def paused_capture(self) -> AbstractContextManager[None]: ...

    def disable(self) -> None: ...


#: Autograd nodes the runtime wrapper may put between a region's output and its compiled
#: backward node (outputs regenerated as views of another output or of an input).
_VIEW_NODES = ("AsStridedBackward0", "ViewBackward0", "AliasBackward0", "UnsafeViewBackward0",
               "ExpandBackward0", "TransposeBackward0", "PermuteBackward0")
_COMPILED_NODE = "CompiledFunctionBackward"


class _PerThread(threading.local):
    depth = 0  # > 0 while a compiled forward region runs on this thread


class Regions:
    """Records compiled graphs as single ops for one backend."""

    def __init__(self, backend: CompileHost) -> None:
        self.backend = backend
        self.local = _PerThread()
        # Compiled backward nodes running now: id -> node (kept alive, so the id stays unique)
        # with the pending record's inputs.
        self.nodes: dict[int, tuple[Any, list[Fp], list[Fp], int]] = {}

    # -- state --------------------------------------------------------------------------
    def inside(self) -> bool:
        """Is a compiled region running on this thread (its inner ops are not recorded)?"""
        if self.local.depth:
            return True
        if self.nodes:
            node = torch._C._current_autograd_node()
            return node is not None and id(node) in self.nodes
        return False

    def recording(self) -> bool:
        backend, recorder = self.backend, self.backend.recorder
        return (recorder.active and recorder.window and not backend.paused
                and not backend.disabled and recorder.depth == 0 and not self.inside()
                and not cuda.capturing())  # Note [CUDA graphs] in cuda.py

    def failed(self) -> None:
        """Trouble in nondet's own code: report it as nondet's bug, let the script run on."""
        self.backend.hook_failed()

    # -- forward ------------------------------------------------------------------------
    def forward(self, compiled_fn: Callable[..., Any], name: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        try:
            before = self._before(name, args, kwargs)
        except Exception:
            self.failed()
            return compiled_fn(*args, **kwargs)
        self.local.depth += 1
        try:
            out = compiled_fn(*args, **kwargs)
        finally:
            self.local.depth -= 1
        try:
            self._after(before, out)
        except Exception:
            self.failed()
        return out

    def _before(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        backend = self.backend
        session = backend.session
        node = torch._C._current_autograd_node()
        if node is not None:
            phase = int(Phase.BACKWARD)
            module, source = backend.node_origin(node)
        else:
            phase = int(backend.phase)
            module = backend.current_module()
            source = _call_site(session.sources)
        ctx = (phase, module, source)
        tensors, scalars = _split(args, kwargs)
        ins, taints, flags = self._inputs(tensors, ctx)
        # Weak references: a boxed call frees its inputs as it goes; we must not keep them.
        versions = [(weakref.ref(t), _version(t)) for t in tensors]
        return name, ctx, flags, ins, taints, scalars, versions

    def _after(self, before: Any, out: Any) -> None:
        name, (phase, module, source), flags, ins, taints, scalars, versions = before
        backend = self.backend
        recorder, session = backend.recorder, backend.session
        outputs = list(_tensors(out))
        for ref, version in versions:  # inputs the graph wrote are outputs too
            t = ref()
            if t is not None and version >= 0 and _version(t) != version:
                flags |= Flag.INPLACE
                if not any(t is o for o in outputs):
                    outputs.append(t)
        with backend.paused_capture():
            for t in outputs:
                if flags & Flag.INPLACE:
                    recorder.note_write(t)
            outs = [recorder.remember(t, recorder.fingerprint(t)) for t in outputs]
        numel = outputs[0].numel() if outputs else 0
        if outputs and outputs[0].device.type != "cpu":
            flags |= Flag.CUDA if outputs[0].device.type == "cuda" else Flag.OTHER_DEVICE
        recorder.add(Kind.OP, phase, flags, session.intern(name), module, source, outs, ins,
                     taints, tuple(scalars), numel, outputs)
        if phase != Phase.BACKWARD:
            self._hook_backward(outputs, session.intern(f"{name} (backward)"), module, source)

    def _inputs(self, tensors: list[torch.Tensor],
                ctx: tuple[int, int, int]) -> tuple[list[Fp], list[Fp], int]:
        """A record's input fingerprints, and those of memory it reads that was never
        written (taints: the record is flagged ``READS_UNINIT``)."""
        backend = self.backend
        ins: list[Fp] = []
        taints: list[Fp] = []
        flags = int(Flag.NONE)
        with backend.paused_capture():
            for t in tensors:
                fp = backend.recorder.lookup(t, ctx)
                if fp.uninit:
                    taints.append(fp)
                    flags |= Flag.READS_UNINIT
                else:
                    ins.append(fp)
        return ins, taints, flags

    # -- backward -----------------------------------------------------------------------
    def _hook_backward(self, outputs: list[torch.Tensor], name_id: int, module: int,
                       source: int) -> None:
        seen: set[int] = set()
        for t in outputs:
            node = _compiled_node(t.grad_fn)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            ref = weakref.ref(self)
            node.register_prehook(functools.partial(_backward_pre, ref, node))
            node.register_hook(functools.partial(_backward_post, ref, name_id, module, source))

    def backward_pre(self, node: Any, grad_outputs: tuple[Any, ...]) -> None:
        if not self.recording():
            return
        module, source = self.backend.node_origin(node)
        ctx = (int(Phase.BACKWARD), module, source)
        tensors = [t for t in grad_outputs if isinstance(t, torch.Tensor)]
        ins, taints, flags = self._inputs(tensors, ctx)
        self.nodes[id(node)] = (node, ins, taints, flags)

    def backward_post(self, name_id: int, module: int, source: int,
                      grad_inputs: tuple[Any, ...]) -> None:
        node = torch._C._current_autograd_node()
        pending = self.nodes.pop(id(node), None) if node is not None else None
        if pending is None:
            return
        _, ins, taints, flags = pending
        backend = self.backend
        recorder = backend.recorder
        outputs = [t for t in grad_inputs if isinstance(t, torch.Tensor)]
        with backend.paused_capture():
            outs = [recorder.remember(t, recorder.fingerprint(t)) for t in outputs]
        numel = outputs[0].numel() if outputs else 0
        recorder.add(Kind.OP, int(Phase.BACKWARD), flags, name_id, module, source, outs, ins,
                     taints, (), numel, outputs)


@nocompile.internal  # Note [nondet's frames and Dynamo]
def _backward_pre(ref: weakref.ref[Regions], node: Any, grad_outputs: tuple[Any, ...]) -> None:
    regions = ref()
    if regions is None or regions.backend.disabled:
        return
    try:
        regions.backward_pre(node, grad_outputs)
    except Exception:
        regions.failed()


@nocompile.internal
def _backward_post(ref: weakref.ref[Regions], name_id: int, module: int, source: int,
                   grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
    regions = ref()
    if regions is None or regions.backend.disabled:
        return
    try:
        regions.backward_post(name_id, module, source, grad_inputs)
    except Exception:
        regions.failed()


def _compiled_node(node: Any) -> Any:
    """The compiled autograd function's node behind a region output, or None."""
    for _ in range(3):
        if node is None:
            return None
        name = node.name()
        if _COMPILED_NODE in name:
            return node
        if name not in _VIEW_NODES or not node.next_functions:
            return None
        node = node.next_functions[0][0]
    return None


def _call_site(sources: Any) -> int:
    """The user's line that called the compiled function: the first user frame that is not
    code Dynamo rewrote (that frame stands for the compiled function itself)."""
    from torch._dynamo.utils import orig_code_map

    frame: FrameType | None = sys._getframe(3)  # _before, forward, region: never the user's
    while frame is not None:
        code = frame.f_code
        if code not in orig_code_map and sources.user_file(code.co_filename):
            return int(sources.intern_location(code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return -1


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], list[Any]]:
    """A graph's tensor inputs and its number inputs (dynamic sizes), in order. A boxed call
    passes them as one list."""
    tensors: list[torch.Tensor] = []
    scalars: list[Any] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat)):
            scalars.append(value)

    visit(args)
    visit(tuple(kwargs.values()))
    return tensors, scalars

