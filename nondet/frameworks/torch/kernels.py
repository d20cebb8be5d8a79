"""torch.optim's per-parameter update kernels recorded as one op per call.

Note [Optimizer kernels as one record]
Adam's default CPU implementation (``torch.optim.adam._single_tensor_adam``) runs about
nine aten ops per parameter (``add_`` of the step, ``lerp_``, ``mul_``, ``addcmul_``,
``item``, ``sqrt``, ``div``, ``add_``, ``addcdiv_``): 144 of the narrow benchmark model's
217 records per step, every one of them pointwise, so derived (Note [Derived fingerprints]
in cache.py), and never able to create a difference by itself; each still paid a Python
dispatch and a record. A call of such a kernel is recorded here as one op instead, run
with the recorder's mode off (native speed), named after the kernel
(``torch.optim.adam._single_tensor_adam``):

- its inputs are every tensor of its list arguments (parameters, gradients, the state),
  looked up as any op's inputs are (an entry is recorded as an entry, a stale tensor is
  hashed again, uninitialized memory taints), and its Python numbers and flags are its
  scalar arguments (learning rate, betas, ...);
- its outputs are the tensors of its list arguments after the call (whatever it wrote,
  and the gradients it did not: written through a version counter or not, their
  fingerprints stay exact), each *derived* from the call's inputs at the same list index
  and the scalars: these kernels update parameter ``i`` from the ``i``-th element of each
  list only (read in torch's code, and tested: ``test_torch_kernels.py``).

This is as exact as the ops it replaces: their outputs were derived from their inputs, so
the only difference they could be named for was a differing Python number (an entry),
which the kernel's scalars carry now, and a difference in an input still shows as that
input's. What it gives up: a finding inside the kernel names the kernel, not the aten op,
and the per-op structure inside it is not compared (a kernel that ran other ops shows
differing outputs from matching inputs: named as the kernel).

It applies only where that holds. The first call for each *path* (the kernel, the types
and zero-ness of its numbers, its flags, its tensors' types, dtypes and devices, None
items) is recorded op by op and checked: if any op's output was not derived (hashed,
uninitialized memory, a collective...), that path keeps being recorded op by op for the
rest of the run; else later calls on it are recorded whole. Both runs take the same
decisions (the same ops run on the same path). Recorded op by op as well: calls while
another dispatch mode is pushed (ours must be the only one, to be taken off), inside
autograd (an optimizer step in a backward hook), with grad mode on (``differentiable``),
while compiling or capturing a CUDA graph, in a child process sharing memory, on another
thread, and with tensor subclasses, sparse tensors or tensor hyperparameters.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from nondet.fingerprint import name_code, pack_words, scalar_value
from nondet.frameworks.fp import Fp
from nondet.frameworks.torch import cuda
from nondet.frameworks.torch import tensors as safe
from nondet.frameworks.torch.cache import _describe
from nondet.frameworks.torch.cache import _out_meta as _cached_out_meta
from nondet.frameworks.torch.compiled import in_region
from nondet.records import Flag, Kind

if TYPE_CHECKING:
    from nondet.frameworks.base import Session
    from nondet.frameworks.torch.ops import OpRecorder

#: (module, function) of the kernels recorded whole: each updates parameter ``i`` from the
#: ``i``-th element of its list arguments alone (AdamW runs Adam's).
KERNELS = (("torch.optim.adam", "_single_tensor_adam"),
           ("torch.optim.sgd", "_single_tensor_sgd"))

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_autograd_node = torch._C._current_autograd_node
_dispatch_depth = torch._C._len_torch_dispatch_stack


class KernelHost(Protocol):
    """What the wrapped kernels ask of the torch backend (testing.KernelHost in tests)."""

    recorder: OpRecorder
    mode: Any  # the recorder's dispatch mode while it is pushed, else None
    disabled: bool
    paused: bool
    phase: Any
    session: Session

    def current_module(self) -> int: ...

    def hook_failed(self) -> None: ...


def install(backend: KernelHost) -> None:
    """Wrap the kernels (looked up by name at each call in torch.optim's functional API)."""
    calls = KernelCalls(backend)
    for module_name, name in KERNELS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - torch.optim is always there
            continue
        original = getattr(module, name, None)
        if callable(original):
            setattr(module, name, calls.wrap(original, f"{module_name}.{name}"))


class KernelCalls:
    """What the wrapped kernels share: the backend, and each path's verdict."""

    def __init__(self, backend: KernelHost) -> None:
        self.backend = backend
        #: path -> recorded whole (True) or op by op (False); absent: not seen yet
        self.paths: dict[tuple[Any, ...], bool] = {}
        self.ran = False  # the kernel of the call under way has run (recorded whole)

    def wrap(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(original)
        def kernel(*args: Any, **kwargs: Any) -> Any:
            # Traced by Dynamo (a compiled ``opt.step``): the kernel alone, before any of
            # nondet's state is read, which Dynamo would guard on and recompile the user's
            # function when it changes (Note [nondet's frames and Dynamo] in nocompile.py)
            if torch.compiler.is_compiling():
                return original(*args, **kwargs)
            return self.call(original, name, args, kwargs)

        kernel.__nondet_kernel__ = original  # type: ignore[attr-defined]
        return kernel

    def call(self, original: Callable[..., Any], name: str, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        backend = self.backend
        recorder = backend.recorder
        mode = backend.mode
        if (mode is None or backend.disabled or backend.paused or not recorder.active
                or not recorder.window or torch.compiler.is_compiling()):
            return original(*args, **kwargs)
        self.ran = False
        try:
            path = self._path(original, args, kwargs, recorder, mode)
            whole = self.paths.get(path) if path is not None else False
            if whole:
                self._whole(original, name, args, kwargs, recorder)
                return None  # the kernels return nothing
        except _KernelRaised as raised:
            raise raised.error from None  # the kernel's own error: the script's to see
        except Exception:
            # nondet's own (Note [Errors in the recorder] in ops.py): reported, capture
            # off, the kernel run once, never twice
            backend.hook_failed()
            return None if self.ran else original(*args, **kwargs)
        if whole is None:  # the first call on this path: op by op, and checked
            before = recorder.underived
            out = original(*args, **kwargs)
            self.paths[path] = recorder.underived == before  # type: ignore[index]
            return out
        return original(*args, **kwargs)

    # -- which calls ------------------------------------------------------------------------
    def _path(self, original: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any], recorder: OpRecorder, mode: Any) -> tuple[Any, ...] | None:
        """The call's path (what decides which ops the kernel runs), or None where it is
        recorded op by op in any case."""
        if (recorder.shared_is_volatile or not recorder.threads.on_owner()
                or _dispatch_depth() != 1 or _get_current_dispatch_mode() is not mode
                or _autograd_node() is not None or torch.is_grad_enabled()
                or cuda.capturing() or in_region()):
            return None
        path: list[Any] = [original]
        for key, value in (*enumerate(args), *sorted(kwargs.items())):
            kind = type(value)
            if kind is list or kind is tuple:
                kinds: set[Any] = set()
                for t in value:
                    if t is None:
                        kinds.add(None)
                        continue
                    if type(t) not in _PLAIN or t.layout != torch.strided:
                        return None
                    kinds.add((type(t), t.dtype, t.device.type))
                path.append((key, len(value) > 0, frozenset(kinds)))
            elif value is None or kind is bool or kind is str:
                path.append((key, value))
            elif kind is int or kind is float:
                path.append((key, kind, value == 0))
            else:  # a tensor hyperparameter, anything else: op by op
                return None
        return tuple(path)

    # -- one record for the call ------------------------------------------------------------
    def _whole(self, original: Callable[..., Any], name: str, args: tuple[Any, ...],
               kwargs: dict[str, Any], recorder: OpRecorder) -> None:
        backend = self.backend
        if recorder.settling:
            recorder.settle()
        if recorder.stamp is not None:
            recorder.apply_stamp()
        ctx = (int(backend.phase), backend.current_module(), backend.session.sources.here(2))
        named = sorted(kwargs.items())
        lists = [v for v in (*args, *(v for _, v in named)) if type(v) in (list, tuple)]
        scalars: list[Any] = [v for v in (*args, *(v for _, v in named))
                              if type(v) in (bool, int, float)]
        # inputs, per list index: what parameter i's update reads
        flags = 0
        per_index: dict[int, list[Fp]] = {}
        ins: list[Fp] = []
        taints: list[Fp] = []
        for values in lists:
            for i, t in enumerate(values):
                if t is None:
                    continue
                got: list[Fp] = []
                tainted: list[Fp] = []
                flags |= recorder._input(t, False, ctx, got, tainted, [])
                per_index.setdefault(i, []).extend((*got, *tainted))
                ins.extend(got)
                taints.extend(tainted)
        try:
            with _pop_mode_temporarily():  # ours, the only one (checked in _path)
                original(*args, **kwargs)
        except Exception as error:
            raise _KernelRaised(error) from error
        self.ran = True
        # each output: derived from its index's inputs and the scalars (one derived value
        # per index, then one per tensor over it and its list and description)
        code = name_code(name)
        call_meta = (code, *[scalar_value(s) for s in scalars])
        call_packed = pack_words(call_meta)
        at_index: dict[int, Fp] = {}
        for i, parents in per_index.items():
            fp = Fp()
            fp.parents, fp.meta = tuple(parents), call_meta
            at_index[i] = recorder._derived(fp, call_packed)
        outputs = [t for values in lists for t in values if t is not None]
        # every tensor of the call counts as written, with or without a version bump (a
        # write through ``.data`` bumps none): its storage's write count first, so that
        # views and other tensors on it are stale, then its entry
        states = recorder.storages.state_of
        storages = [states(t.untyped_storage()) for t in outputs]  # plain (_path)
        for state in storages:
            state.writes += 1
            state.origin = None
        cache = recorder.cache
        out_fps: list[Fp] = []
        at = iter(zip(outputs, storages, strict=True))
        for k, values in enumerate(lists):
            for i, item in enumerate(values):
                if item is None:
                    continue
                t, state = next(at)
                fp = Fp()
                fp.parents = (at_index[i],) if i in at_index else tuple(ins)
                fp.meta, packed = _out_meta(k, t)
                fp = recorder._derived(fp, packed)
                cache[id(t)] = (weakref.ref(t), t._version, state, state.writes, fp)
                state.uninit = False
                out_fps.append(fp)
        numel = safe.numel(outputs[0]) if outputs else 0
        if outputs and not outputs[0].is_cpu:
            flags |= Flag.CUDA if outputs[0].device.type == "cuda" else Flag.OTHER_DEVICE
        recorder.add(Kind.OP, ctx[0], flags | Flag.INPLACE, backend.session.intern(name),
                     ctx[1], ctx[2], out_fps, ins, taints, tuple(scalars), numel, [])


def _out_meta(k: int, t: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    """``(list position, *describe(t))`` of a kernel's output, and the same words packed
    (a plain CPU tensor's from cache.py's table: a kernel sees the same few every step)."""
    if type(t) in _PLAIN and t.is_cpu:
        return _cached_out_meta(k, t)
    meta = (k, *_describe(t))
    return meta, pack_words(meta)


class _KernelRaised(Exception):
    """The kernel itself raised while recorded whole: re-raised unchanged to the script."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
