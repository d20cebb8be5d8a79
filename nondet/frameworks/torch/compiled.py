"""``torch.compile`` under nondet: compiled code is compiled, and each compiled region is one op.

Dynamo refuses to compile a frame while a dispatch mode is on the stack, unless the mode
declares ``ignore_compile_internals`` (``CaptureMode`` does): Dynamo then traces and compiles
with the mode switched off, and runs the compiled artifact with it switched back on. So a
script compiles exactly the same graphs under nondet as without it, and its Inductor kernels
(and their nondeterminism: ``atomic_add`` in a scatter/index backward, split reductions) are
what runs.

Ops inside a compiled region are not seen one by one: the generated kernels do not go
through the dispatcher, and the few aten calls that do (extern ``mm``, the runtime wrapper's
views) are passed through unrecorded. Instead each call of a compiled graph is recorded as
ONE op, named ``compiled:<qualified name of the compiled function>`` (``compiled:Model.forward``;
a graph after a graph break is named after Dynamo's resume function), with the fingerprints
of all its tensor inputs (the graph's inputs include the parameters it reads) and outputs
(including inputs it mutated, e.g. BatchNorm running stats), the module and the user's
source line of the call. Its backward (the compiled autograd function's backward node) is
likewise one op, ``compiled:<name> (backward)``, attributed to the same module and line.
A difference made inside a region is therefore reported at that region. To see its ops one
by one, run with ``TORCH_COMPILE_DISABLE=1`` (the region then runs eagerly, under the
mode), at the price of running a different program: eager kernels may not have the race.

How: ``OutputGraph.call_user_compiler`` (where Dynamo hands a graph to the backend) is
wrapped once ``torch._dynamo.output_graph`` is imported (never imported by nondet itself),
so every compiled graph's callable goes through ``Regions.forward``, which does nothing but
call it unless op-level capture is recording.
"""

from __future__ import annotations

import functools
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import FrameType
from typing import Any, Protocol

import torch

from nondet.frameworks.base import RecorderHost
from nondet.frameworks.fp import Fp
from nondet.frameworks.torch import cuda
from nondet.records import Flag, Kind, Phase


class CompileHost(RecorderHost, Protocol):
    """What region recording asks of the torch backend (it never imports the backend)."""

    paused: bool
    recorder: Any  # ops.OpRecorder (ops imports this module: typed loosely to stay acyclic)

    def node_origin(self, node: Any) -> tuple[int, int]: ...

    def paused_capture(self) -> AbstractContextManager[None]: ...

    def disable(self) -> None: ...

#: Autograd nodes the runtime wrapper may put between a region's output and its compiled
#: backward node (outputs regenerated as views of another output or of an input).
_VIEW_NODES = ("AsStridedBackward0", "ViewBackward0", "AliasBackward0", "UnsafeViewBackward0",
               "ExpandBackward0", "TransposeBackward0", "PermuteBackward0")
_COMPILED_NODE = "CompiledFunctionBackward"

_current: Regions | None = None  # the installed backend's regions (one backend per process)
_patched = False


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
        recorder, session = backend.recorder, backend.session
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
        flags = int(Flag.NONE)
        ins: list[Fp] = []
        taints: list[Fp] = []
        with backend.paused_capture():
            for t in tensors:
                fp = recorder.lookup(t, ctx)
                if fp.uninit:
                    taints.append(fp)
                    flags |= Flag.READS_UNINIT
                else:
                    ins.append(fp)
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
        backend = self.backend
        recorder = backend.recorder
        module, source = backend.node_origin(node)
        ctx = (int(Phase.BACKWARD), module, source)
        ins: list[Fp] = []
        taints: list[Fp] = []
        flags = int(Flag.NONE)
        with backend.paused_capture():
            for t in grad_outputs:
                if isinstance(t, torch.Tensor):
                    fp = recorder.lookup(t, ctx)
                    if fp.uninit:
                        taints.append(fp)
                        flags |= Flag.READS_UNINIT
                    else:
                        ins.append(fp)
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


def _backward_pre(ref: weakref.ref[Regions], node: Any, grad_outputs: tuple[Any, ...]) -> None:
    regions = ref()
    if regions is None or regions.backend.disabled:
        return
    try:
        regions.backward_pre(node, grad_outputs)
    except Exception:
        regions.failed()


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


# -- installation ----------------------------------------------------------------------------
def in_region() -> bool:
    """For ``CaptureMode``: ops of a compiled region are not recorded one by one."""
    regions = _current
    return regions is not None and regions.inside()


def wrap(compiled_fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """The callable Dynamo runs for one compiled graph, recorded as ``name`` when capturing."""

    def region(*args: Any, **kwargs: Any) -> Any:
        regions = _current
        if regions is None or not regions.recording():
            return compiled_fn(*args, **kwargs)
        return regions.forward(compiled_fn, name, args, kwargs)

    region._boxed_call = getattr(compiled_fn, "_boxed_call", False)  # type: ignore[attr-defined]
    region.__wrapped__ = compiled_fn  # type: ignore[attr-defined]
    return region


def region_name(code: Any) -> str:
    return "compiled:" + str(getattr(code, "co_qualname", None) or getattr(code, "co_name", "?"))


def _patch_dynamo() -> None:
    global _patched
    if _patched:
        return
    from torch._dynamo import output_graph

    original = output_graph.OutputGraph.call_user_compiler

    @functools.wraps(original)
    def call_user_compiler(graph: Any, gm: Any, example_inputs: Any) -> Any:
        with _compiling():
            compiled_fn = original(graph, gm, example_inputs)
        if getattr(graph, "export", False):
            return compiled_fn  # torch.export: nothing runs here
        _force_lazy(compiled_fn)
        return wrap(compiled_fn, region_name(graph.root_tx.f_code))

    output_graph.OutputGraph.call_user_compiler = call_user_compiler  # type: ignore[method-assign,assignment]
    _patched = True


@contextmanager
def _compiling() -> Iterator[None]:
    """The backend compiler (AOTAutograd, Inductor) runs Python that makes tensors (fake
    ones, mostly): nondet's hooks must not take that for the script's work."""
    regions = _current
    if regions is None:
        yield
        return
    backend = regions.backend
    was = backend.paused, backend.recorder.active
    backend.paused, backend.recorder.active = True, False
    try:
        yield
    finally:
        backend.paused, backend.recorder.active = was


def _force_lazy(compiled_fn: Any) -> None:
    """Dynamo compiles a lazy GraphModule returned by the backend (eager, aot_eager) on
    the spot, which it no longer recognizes behind our wrapper: do it here."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    lazy = compiled_fn if isinstance(compiled_fn, _LazyGraphModule) else getattr(
        compiled_fn, "__self__", None)
    if isinstance(lazy, _LazyGraphModule):
        _LazyGraphModule.force_recompile(lazy)


def install(backend: CompileHost) -> None:
    """Record compiled regions for ``backend`` from now on (see the module docstring)."""
    global _current
    _current = Regions(backend)
    from nondet.frameworks import after_import

    def patch() -> None:
        try:
            _patch_dynamo()
        except Exception:  # another torch version: regions then run op by op under the mode
            backend.session.send_meta({"note": "torch.compile regions could not be hooked: "
                                               + traceback.format_exc(limit=1)})

    after_import("torch._dynamo.output_graph", patch)
