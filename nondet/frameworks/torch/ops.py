"""Op-level capture for PyTorch: a TorchDispatchMode that fingerprints every aten op.

``CaptureMode`` is pushed while a step with op-level capture runs. Below autograd it sees
every op of forward, backward and the optimizer, calls it, fingerprints its outputs
(including inputs it mutated) and records one 64-byte row per op with the fingerprint of
its inputs, so the comparison can find the first op whose output differs while its inputs
matched. It composes with other modes like any mode: whatever is pushed after it sees the
ops first. It cannot see work done outside the dispatcher (NumPy, Python threads, custom
C++ that bypasses ATen); those values show up as *entry points* when they are first used.

TODO: Limitations
- Ops run in threads other than the one that pushed the mode (user threads, a DataLoader's
  pin-memory thread) are not recorded; their results appear as entry points.
- In-place writes made outside the dispatcher (through ``.numpy()`` views, DLPack) are noticed
  only through the version counter, not attributed to a line.
- Tensor subclasses with their own ``__torch_dispatch__`` are recorded without fingerprints.
- On CUDA, fingerprints of tensors written on a side stream are taken on the current stream.

Note [Uninitialized memory]
Outputs of ``empty`` & co. hold whatever the allocator left there, so they differ between
runs without meaning anything. They are never compared (``Flag.UNINIT_OUTPUT``), a view of
them inherits that, and an op that fully overwrites such a tensor (``fill_``, ``uniform_``,
``copy_``, any ``out=``) ignores its old value. An op that *reads* one keeps its fingerprint
apart (``taint_fp``): if that op's output then differs while its other inputs matched, the
finding is "reads uninitialized memory", never a false alarm on the ``empty`` itself.

The rule behind it: a value that is overwritten before anything reads it is never evidence.
``set_(storage)`` wraps a storage made outside the ops: ``copy.deepcopy`` (torchmetrics
states, Lightning's ``self.log``, EMA copies) makes a fresh, uninitialized
``UntypedStorage(nbytes)``, wraps it and then ``copy_``s into it; ``torch.load`` wraps
storages filled from the file. Which of the two it is cannot be told at the ``set_``, so
its output is treated as uninitialized memory that remembers where it was wrapped
(``StorageState.origin``): overwritten first, it was never evidence; read first, the read
records it as an entry point ("tensor from a storage") with its fingerprint at that moment.
A ``set_`` with a geometry onto a storage already known is an alias of known values. A
``set_`` without one is a handle on all of a storage's bytes (``UntypedStorage.copy_``),
including bytes outside every tensor on it, which are uninitialized (a scalar loss can own
a 64-byte storage): such a handle is uninitialized memory, never an entry. The ``set_``
record itself carries no output fingerprint. A copy of uninitialized memory (``MOVE_OPS``
with no initialized input) is uninitialized memory too, not a read: the op that finally
computes with it is the one that reads it.

Note [Derived fingerprints]
A view's values are fixed by its base's values and its geometry (dtype, shape, strides,
offset), and a pointwise op's output (``POINTWISE_OPS``: elementwise, no reduction, no RNG)
is fixed by its inputs, its scalar arguments and its output's shape and dtype. Their
fingerprints are therefore *derived* from those, without reading the tensor: that skips
most of the memory traffic of hashing (activations of ReLU, optimizer arithmetic). It
cannot hide an injection: a derived fingerprint differs only if an input's does, and the
input that differs was recorded earlier. An op on the list that read uninitialized memory
still shows as such, because its uninitialized inputs are among the parents.

Note [Fingerprint cache]
Each tensor is fingerprinted once, when an op produces it; consumers look the fingerprint up
by tensor identity: a dict keyed by ``id`` whose weak reference must still point at the same
tensor (no effect on lifetimes; nothing is attached to user tensors, so checkpoints stay
clean; dead entries are pruned at step ends, and a recycled ``id`` never matches). An entry
is current only if both the tensor's version counter and its storage's write count (bumped
by every recorded op that mutates any tensor on that storage) are unchanged:
``p.data.sub_(...)`` does not bump ``p``'s version counter, but it does bump the storage's
write count. Inference tensors have no version counter: the write count alone decides
(their writes in other threads are not seen, as for any op there). The cache lives only
while the op window is open, because writes outside it are not seen. A tensor never
produced by a recorded op, over a storage never seen, is an entry point; storages are
known by identity, never by address (Note [Storage identity] in tensors.py). Views are
never hashed: see ``Fp``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nondet.fingerprint import combine, scalar_value
from nondet.frameworks.base import RecorderHost
from nondet.frameworks.fp import Fp, combined
from nondet.frameworks.torch import tensors as safe
from nondet.frameworks.torch.compiled import in_region
from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.optable import OpInfo, op_info
from nondet.frameworks.torch.tensors import Storages, StorageState
from nondet.records import OP_DTYPE, Flag, Kind, Phase


class TorchHost(RecorderHost, Protocol):
    """What the recorder asks of the torch backend (it never imports the backend)."""

    hasher: TorchHasher

    def tensor_name(self, t: torch.Tensor) -> str | None: ...

    def node_origin(self, node: Any) -> tuple[int, int]: ...

    def dump_and_exit(self, tensors: list[torch.Tensor]) -> None: ...

    def keep(self, step: int, index: int, tensors: list[torch.Tensor]) -> None: ...

_VIEW_TAG = 0x71E3_5EED
_describe = safe.describe


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's return value or argument: a tensor, or a list/tuple of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


class OpRecorder:
    """Fingerprint cache, pending device values and the current step's records."""

    def __init__(self, backend: TorchHost) -> None:
        self.backend = backend
        self.session = backend.session
        self.hasher = backend.hasher
        self.window = False  # op-level capture is on for the current step
        self.active = False  # ... and nondet is not running its own ops right now
        self.cache: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, int], Fp]] = {}
        self.storages = Storages()  # Note [Storage identity]
        self.pending: list[Fp] = []
        self.records: list[tuple[Any, ...]] = []
        self.infos: dict[Any, OpInfo] = {}
        self.stamp: tuple[list[torch.Tensor], int, int] | None = None
        self.creating: tuple[str, str] | None = None  # entry label while a wrapper runs
        self.depth = 0  # > 0 while an op's own implementation runs (custom ops in Python)
        self.dump_at = self.session.config.dump
        self.keep_outputs = self.session.config.keep_bytes > 0

    # -- fingerprints -----------------------------------------------------------------------
    def fingerprint(self, t: torch.Tensor, fp: Fp | None = None) -> Fp:
        """Start fingerprinting ``t`` (into ``fp`` if given, e.g. a lazy one)."""
        fp = fp or Fp()
        content = self.hasher.content(t) if safe.readable(t) else None
        if content is None:
            fp.value = 0  # unhashable: compared as "no information"
            return fp
        fp.content = content
        fp.meta = _describe(t)
        self.pending.append(fp)
        return fp

    def fingerprint_many(self, tensors: list[torch.Tensor]) -> list[Fp]:
        """One fingerprint for a group of tensors (per device): their words concatenated."""
        meta = tuple(x for t in tensors for x in _describe(t))
        fps = []
        for content in self.hasher.content_of_many(tensors).values():  # one per device
            fp = Fp()
            fp.content, fp.meta = content, meta
            self.pending.append(fp)
            fps.append(fp)
        return fps

    def derive(self, base: Fp, base_tensor: torch.Tensor, view: torch.Tensor,
               uninit: bool) -> Fp:
        """A view's fingerprint from its base's (see ``Fp``); lazy if the base is lazy."""
        fp = Fp(uninit=uninit)
        if base.lazy:
            return fp
        where = safe.geometry(view, base_tensor)
        if where is None:  # no strides (sparse, nested): read the view itself
            return self.fingerprint(view, fp)
        fp.parents = (base,)
        fp.meta = (_VIEW_TAG, *_describe(view), *where)
        self.pending.append(fp)
        return fp

    def derive_output(self, info: OpInfo, inputs: list[Fp], scalars: list[Any],
                      out: torch.Tensor) -> Fp:
        """A pointwise op's output fingerprint from its inputs' (Note [Derived fingerprints])."""
        fp = Fp()
        fp.parents = tuple(inputs)
        fp.meta = (info.code, *_describe(out), *(scalar_value(x) for x in scalars))
        self.pending.append(fp)
        return fp

    # -- the cache (see Note [Fingerprint cache]) -------------------------------------------
    def open_window(self) -> None:
        self.close_window()
        self.window = self.active = True

    def close_window(self) -> None:
        self.window = self.active = False
        self.cache = {}
        self.storages.clear()
        self.stamp = None

    def _stamp_of(self, t: torch.Tensor) -> tuple[int, int]:
        state = self.storages.get(t)
        version = safe.version(t)
        return -1 if version is None else version, 0 if state is None else state.writes

    def note_write(self, t: torch.Tensor) -> None:
        state = self.storages.state(t)
        state.writes += 1
        state.origin = None  # written by a recorded op: no longer an unknown storage

    def remember(self, t: torch.Tensor, fp: Fp) -> Fp:
        if self.window:
            state = self.storages.state(t)
            version = safe.version(t)
            self.cache[id(t)] = (weakref.ref(t), (-1 if version is None else version,
                                                  state.writes), fp)
            state.uninit = fp.uninit
        return fp

    def _hit(self, t: torch.Tensor) -> tuple[tuple[int, int], Fp] | None:
        entry = self.cache.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1], entry[2]

    def prune(self) -> None:
        """Drop cache entries of tensors that no longer exist."""
        self.cache = {k: e for k, e in self.cache.items() if e[0]() is not None}

    def forget(self, t: torch.Tensor) -> None:
        """Treat ``t`` as never seen: its next use is an entry point with a fresh fingerprint.

        Used for parameters at the start of each captured step, so values changed outside
        the recorded ops (other processes through shared memory, NumPy views) show up.
        """
        self.cache.pop(id(t), None)
        state = self.storages.get(t)
        if state is not None:
            state.uninit = state.origin = None

    def known(self, t: torch.Tensor) -> Fp | None:
        """The cached fingerprint of ``t`` if it is current (materialized if lazy)."""
        if not self.window:
            return None
        hit = self._hit(t)
        if hit is None or hit[0] != self._stamp_of(t):
            return None
        fp = hit[1]
        if fp.lazy:
            self.fingerprint(t, fp)
        return fp

    def lookup(self, t: torch.Tensor, ctx: tuple[int, int, int], materialize: bool = True) -> Fp:
        """Fingerprint of an op input; records an entry point for a tensor never seen."""
        hit = self._hit(t)
        if hit is not None:
            stamp, fp = hit
            if stamp == self._stamp_of(t):
                if fp.lazy and materialize:
                    self.fingerprint(t, fp)
                return fp
            # Changed since we saw it, by something outside the recorded ops: fingerprint
            # again quietly (same in both runs) and keep its uninitialized mark.
            fresh = self.fingerprint(t)
            fresh.uninit = fp.uninit
            return self.remember(t, fresh)
        state = self.storages.get(t)
        if state is not None and state.uninit is not None and self.creating is None:
            # A new tensor object over a storage we already track (``nn.Parameter(data)``,
            # ``.data``): not an entry point; it inherits the uninitialized mark.
            fp = Fp(uninit=state.uninit)
            if materialize:
                self.fingerprint(t, fp)
            return self.remember(t, fp)
        fp = self.remember(t, self.fingerprint(t))
        self.add(Kind.ENTRY, ctx[0], 0, self.entry_name(t), ctx[1], ctx[2], [fp], [], [], (),
                 safe.numel(t), [t])
        return fp

    def read_unknown(self, t: torch.Tensor, state: StorageState) -> Fp:
        """First read of memory that ``set_`` wrapped before nondet saw its contents: an
        entry point now, at the ``set_``'s place (Note [Uninitialized memory])."""
        origin = state.origin
        assert origin is not None
        state.origin = None
        fp = self.fingerprint(t)
        self.add(Kind.ENTRY, origin[0], 0, self._from_storage_name(), origin[1], origin[2],
                 [fp], [], [], (), safe.numel(t), [t])
        return self.remember(t, fp)

    def _from_storage_name(self) -> int:
        return self.session.intern("external:tensor from a storage (aten.set_)")

    def entry_name(self, t: torch.Tensor) -> int:
        if self.creating is not None:
            kind, what = self.creating
        else:
            kind = "external"
            name = self.backend.tensor_name(t)
            sizes = safe.shape(t)
            dims = "[nested]" if sizes is None else str(list(sizes))
            what = name or f"tensor {str(t.dtype).removeprefix('torch.')}{dims}"
        return self.session.intern(f"{kind}:{what}")

    def resolve(self) -> None:
        """Copy pending device sums to the host (one transfer per device), then combine
        each fingerprint with its description. Bases precede their views in the list."""
        if not self.pending:
            return
        by_device: dict[torch.device, list[Fp]] = {}
        for fp in self.pending:
            if isinstance(fp.content, torch.Tensor):
                by_device.setdefault(fp.content.device, []).append(fp)
        for fps in by_device.values():
            values = torch.stack([fp.content for fp in fps]).tolist()  # type: ignore[misc]
            for fp, value in zip(fps, values, strict=True):
                fp.content = value
        for fp in self.pending:
            fp.finalize()
        self.pending = []

    # -- records ----------------------------------------------------------------------------
    def add(
        self, kind: Kind, phase: int, flags: int, name_id: int, module: int, source: int,
        outs: list[Fp], ins: list[Fp], taints: list[Fp], scalars: tuple[Any, ...],
        numel: int, tensors: list[torch.Tensor],
    ) -> None:
        index = len(self.records)
        self.records.append((kind, phase, flags, name_id, module, source, outs, ins, taints,
                             scalars, numel))
        if self.dump_at is not None and self.dump_at == (self.session.step, index):
            self.backend.dump_and_exit(tensors)
        if self.keep_outputs and tensors and all(safe.keepable(t) for t in tensors):
            self.backend.keep(self.session.step, index, tensors)

    def take_rows(self, step: int) -> np.ndarray:
        """The current step's records as OP_DTYPE rows (call after ``resolve``)."""
        rows = [
            (step, i, kind, phase, flags, name, module, source, combined(outs),
             combined(ins), combined(taints),
             combine(scalar_value(s) for s in scalars) if scalars else 0, numel)
            for i, (kind, phase, flags, name, module, source, outs, ins, taints, scalars, numel)
            in enumerate(self.records)
        ]
        self.records = []
        return np.array(rows, dtype=OP_DTYPE) if rows else np.zeros(0, dtype=OP_DTYPE)

    # -- the per-op hot path ----------------------------------------------------------------
    def info(self, func: Any) -> OpInfo:
        info = self.infos.get(func)
        if info is None:
            info = self.infos[func] = op_info(func, self.session.intern(str(func)))
        return info

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        info = self.info(func)
        if self.stamp is not None:
            self.apply_stamp()
        node = torch._C._current_autograd_node()
        if node is not None:
            phase = int(Phase.BACKWARD)
            module, source = self.backend.node_origin(node)
        else:
            phase = int(self.backend.phase)
            module = self.backend.current_module()
            source = self.session.sources.here(2)
        ctx = (phase, module, source)

        if info.view:
            fps = [self.lookup(t, ctx, materialize=False)
                   for value in (*args, *kwargs.values()) for t in tensors_in(value)]
            out = func(*args, **kwargs)
            base = args[0] if args and isinstance(args[0], torch.Tensor) else None
            uninit = any(fp.uninit for fp in fps)
            for t in tensors_in(out):
                fp = self.derive(fps[0], base, t, uninit) if base is not None else Fp(
                    uninit=uninit)
                self.remember(t, fp)
            return out

        flags = info.flags
        known_source: StorageState | None = None
        if info.from_storage:
            known_source = self._source_storage(args, kwargs)
        ins: list[Fp] = []
        taints: list[Fp] = []
        scalars: list[Any] = []
        needs_grad = False
        for position, value in enumerate(args):
            flags |= self._input(value, position in info.overwritten_args, ctx, ins, taints,
                                 scalars)
            needs_grad = needs_grad or (isinstance(value, torch.Tensor) and value.requires_grad)
        for key, value in kwargs.items():
            flags |= self._input(value, key in info.overwritten_kwargs, ctx, ins, taints,
                                 scalars)
        garbage_moved = info.move and bool(taints) and not ins
        if garbage_moved:  # not a read: the copy is as uninitialized as its source
            flags = (flags & ~Flag.READS_UNINIT) | Flag.UNINIT_OUTPUT
            taints = []

        self.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1

        outputs = list(tensors_in(out))
        for position in info.mutated_args:
            _extend_unique(outputs, args[position] if position < len(args) else None)
        for key in info.mutated_kwargs:
            _extend_unique(outputs, kwargs.get(key))
        if (info.mutated_args or info.mutated_kwargs) and not info.from_storage:
            # (set_ changes which memory a tensor shows, not the memory's bytes)
            for t in outputs:
                self.note_write(t)
        out_fps: list[Fp] = []
        if info.uninit_output or garbage_moved:
            for t in outputs:
                self.remember(t, Fp(uninit=True))
        elif info.from_storage:
            self._wrapped_storage(outputs, None if info.storage_handle else known_source,
                                  None if info.storage_handle else ctx)
        elif info.pointwise:
            for t in outputs:
                out_fps.append(self.remember(t, self.derive_output(info, ins + taints,
                                                                   scalars, t)))
        else:
            for t in outputs:
                out_fps.append(self.remember(t, self.fingerprint(t)))
        if not outputs and isinstance(out, (bool, int, float, complex)):
            out_fps.append(Fp(value=scalar_value(out)))  # .item() and friends
        if needs_grad and phase != Phase.BACKWARD:
            # Not gated on grad mode: a custom op's autograd Function runs its forward with
            # grad mode off, yet its output gets a grad_fn afterwards.
            self.stamp = (outputs, module, source)
        numel = 0
        if outputs:
            first = outputs[0]
            numel = safe.numel(first)
            device = first.device.type
            if device != "cpu":
                flags |= Flag.CUDA if device == "cuda" else Flag.OTHER_DEVICE
        measured = not (info.pointwise or info.uninit_output or info.from_storage
                        or garbage_moved)
        self.add(Kind.OP, phase, flags, info.name_id, module, source, out_fps, ins, taints,
                 tuple(scalars), numel, outputs if measured else [])
        return out

    def _source_storage(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> StorageState | None:
        """What is known about the storage a ``set_(storage)`` wraps (None: nothing)."""
        storage = args[1] if len(args) > 1 else kwargs.get("source")
        storage = getattr(storage, "_untyped_storage", storage)  # a TypedStorage
        state = self.storages.get_object(storage)
        return state if state is not None and state.uninit is not None else None

    def _wrapped_storage(self, outputs: list[torch.Tensor], known: StorageState | None,
                         ctx: tuple[int, int, int] | None) -> None:
        """Outputs of ``set_(storage)``: see Note [Uninitialized memory]. ``ctx`` None: a
        handle on all of a storage's bytes, never an entry (they may lie outside every
        tensor on it, uninitialized)."""
        for t in outputs:
            if known is not None:
                # An alias of values already known: fingerprinted when first read.
                self.remember(t, Fp(uninit=bool(known.uninit)))
            else:
                self.remember(t, Fp(uninit=True))
                if ctx is not None:
                    self.storages.state(t).origin = ctx

    def _input(self, value: Any, overwritten: bool, ctx: tuple[int, int, int],
               ins: list[Fp], taints: list[Fp], scalars: list[Any]) -> int:
        if isinstance(value, torch.Tensor):
            items: Any = (value,)
        elif isinstance(value, (list, tuple)):
            items = value
        else:
            items = (value,)
        flags = 0
        for item in items:
            if isinstance(item, torch.Tensor):
                fp = self.lookup(item, ctx, materialize=not overwritten)
                if overwritten:
                    if fp.uninit:
                        flags |= Flag.OVERWRITES_UNINIT
                    continue
                if fp.uninit:
                    state = self.storages.get(item)
                    if state is not None and state.origin is not None:
                        fp = self.read_unknown(item, state)
                if fp.uninit:
                    taints.append(fp)
                    flags |= Flag.READS_UNINIT
                else:
                    ins.append(fp)
            elif isinstance(item, (bool, int, float, complex)) and not overwritten:
                scalars.append(item)
        return flags

    def apply_stamp(self) -> None:
        """Tag the autograd nodes of the previous forward op with its module and line.

        Inside the mode, outputs have no ``grad_fn`` yet (autograd attaches it after we
        return), so this runs at the next op. Backward ops then read the tag from
        ``torch._C._current_autograd_node()`` and are attributed to the forward line.
        """
        outputs, module, source = self.stamp  # type: ignore[misc]
        self.stamp = None
        for t in outputs:
            node = safe.grad_fn(t)  # Note [Reading user tensors] in tensors.py
            if node is not None:
                meta: dict[str, Any] = node.metadata  # type: ignore[assignment]
                if "nondet" not in meta:
                    meta["nondet"] = (module, source)


def _extend_unique(outputs: list[torch.Tensor], value: Any) -> None:
    for t in tensors_in(value):
        if not any(t is o for o in outputs):
            outputs.append(t)


#: Op namespaces that compute nothing (profiler ranges): not recorded.
_PASS_THROUGH = frozenset({"profiler"})


class CaptureMode(TorchDispatchMode):
    """Records every dispatched op while op-level capture is on (see the module docstring).

    The recorder decides what is recorded; when it is inactive (outside the op window, or
    while nondet fingerprints step-level state) ops pass straight through.
    """

    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Lets Dynamo compile while the mode is on (else it runs the script eager and skips
        # the code for good): compiled regions are recorded whole by torch/compiled.py.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.recorder.active or func.namespace in _PASS_THROUGH or in_region():
            return func(*args, **kwargs)
        return self.recorder.dispatch(func, args, kwargs)
