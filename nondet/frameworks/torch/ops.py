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
them inherits that (and is hashed as itself where it is read, never derived from the whole
base: it may show only the part written), and an op that fully overwrites such a tensor
(``fill_``, ``uniform_``, ``copy_``, any ``out=``) ignores its old value. An op that
*reads* one keeps its fingerprint apart (``taint_fp``): if that op's output then differs
while its other inputs matched, the finding is "reads uninitialized memory", never a false
alarm on the ``empty`` itself.

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

The fingerprint cache and the derived fingerprints are described in ``cache.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from nondet.fingerprint import scalar_value
from nondet.frameworks.base import raised_by_script
from nondet.frameworks.fp import Fp
from nondet.frameworks.torch import comm, cuda, shared
from nondet.frameworks.torch import tensors as safe
from nondet.frameworks.torch.cache import OP_DONE, OP_PENDING, OP_RUNNING, FingerprintCache
from nondet.frameworks.torch.compiled import in_region
from nondet.frameworks.torch.optable import OpInfo, accumulates, aux_tensors, op_info
from nondet.frameworks.torch.shared import tensors_in
from nondet.frameworks.torch.steprecords import TorchHost
from nondet.frameworks.torch.tensors import FAKE, StorageState, dispatch_mode
from nondet.records import Flag, Kind, Phase

__all__ = ["CaptureMode", "OpRecorder", "TorchHost", "tensors_in"]



class OpRecorder(FingerprintCache):
    """Records each dispatched op: its inputs' fingerprints (from the cache, or as entry
    points), its outputs' (hashed, derived or uninitialized) and the op row."""

    def __init__(self, backend: TorchHost) -> None:
        super().__init__(backend)
        #: collectives of the step, read once their work is done (comm.py); the backend
        #: replaces it with one that knows about DDP models
        self.collectives = comm.Collectives(self.fingerprint, self.paused, lambda: False)
        #: module -> the script's line of its last forward op: where a checkpoint's
        #: recomputation in the backward, run from library code only, was called from
        self.forward_lines: dict[int, int] = {}

    @contextmanager
    def paused(self) -> Iterator[None]:
        """nondet's own torch work (hashing a collective's output) goes unrecorded."""
        was_active, self.active = self.active, False
        try:
            with _disable_current_modes(), torch.no_grad():
                yield
        finally:
            self.active = was_active

    # -- the per-op hot path ----------------------------------------------------------------
    def info(self, func: Any) -> OpInfo:
        info = self.infos.get(func)
        if info is None:
            info = self.infos[func] = op_info(func, self.session.intern(str(func)))
        return info

    def _info_by_id(self, func: Any) -> OpInfo:
        info = self.info(func)
        self.infos_by_id[id(func)] = (func, info)  # holds func: its id stays its own
        return info

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # by identity: an OpOverload's __hash__ is Python code (overloads live for good)
        known = self.infos_by_id.get(id(func))
        info = known[1] if known is not None and known[0] is func else self._info_by_id(func)
        if self.settling:
            self.settle()
        if self.stamp is not None:
            self.apply_stamp()
        node = _autograd_node()
        if node is not None and self.backend.forward_in_backward_at is None:
            phase = _BACKWARD
            module, source = self.backend.node_origin(node)
        elif node is not None:  # forward code a backward runs: a checkpoint's recomputation
            phase = _BACKWARD
            module = self.backend.current_module()
            source = self.session.sources.here(2)
            if source == self.backend.backward_call_source:  # no line of the script's own
                source = self.forward_lines.get(module, -1)  # inside: its forward's line
        else:
            phase = int(self.backend.phase)
            module = self.backend.current_module()
            source = self.forward_lines[module] = self.session.sources.here(2)
        if info.comm:
            phase = int(Phase.COMM)
        ctx = (phase, module, source)

        if info.view:
            return self._view(func, args, kwargs, ctx)

        flags = info.flags
        if info.accumulate is not None and accumulates(info, args, kwargs):
            flags |= Flag.ACCUMULATES
        known_source: StorageState | None = None
        if info.from_storage:
            known_source = self._source_storage(args, kwargs)
        snap = shared.snapshot(self, func, info, args, kwargs) \
            if self.shared_is_volatile and not info.comm else None  # before its entry's hash
        ins: list[Fp] = []
        taints: list[Fp] = []
        scalars: list[Any] = []
        needs_grad = False
        bucket = False
        if info.comm:  # read afresh: DDP fills its buckets outside the dispatcher (comm.py)
            bucket = self.collectives.is_bucket(
                str(func), node is not None or self.backend.phase == Phase.BACKWARD)
            # a functional collective's wait: its input is being written until it returns
            ins = [] if comm.is_wait(str(func)) else self._comm_inputs(args, kwargs, bucket)
        else:
            cached = None if self.shared_is_volatile else self.cached
            overwritten = info.overwritten_args
            for position, value in enumerate(args):
                kind = type(value)
                if kind is _TENSOR or kind is _PARAMETER:
                    needs_grad = needs_grad or value.requires_grad
                    if cached is not None and position not in overwritten:
                        # the common case: a plain tensor whose fingerprint is cached and
                        # current (what ``_input`` would find, without its general walk)
                        fp = cached(value)
                        if (fp is not None and not fp.uninit and (
                                fp.value is not None or fp.content is not None
                                or fp.parents is not None)):
                            ins.append(fp)
                            continue
                elif kind is int or kind is float or kind is bool:
                    if position not in overwritten:
                        scalars.append(value)
                    continue
                elif value is None:
                    continue
                else:
                    needs_grad = needs_grad or (isinstance(value, torch.Tensor)
                                                and value.requires_grad)
                flags |= self._input(value, position in overwritten, ctx, ins, taints,
                                     scalars)
            for key, value in kwargs.items():
                flags |= self._input(value, key in info.overwritten_kwargs, ctx, ins, taints,
                                     scalars)
        garbage_moved = info.move and bool(taints) and not ins
        if garbage_moved:  # not a read: the copy is as uninitialized as its source
            flags = (flags & ~Flag.READS_UNINIT) | Flag.UNINIT_OUTPUT
            taints = []

        self.depth += 1
        try:
            out = self.run_op(func, args, kwargs)
        finally:
            self.depth -= 1
        if self.shared_is_volatile and not info.comm:  # Note [Writes during an op]
            shared.reread_inputs(self, info, args, kwargs, snap)

        outputs = [out] if isinstance(out, torch.Tensor) else list(tensors_in(out))
        for position in info.mutated_args:
            _extend_unique(outputs, args[position] if position < len(args) else None)
        for key in info.mutated_kwargs:
            _extend_unique(outputs, kwargs.get(key))
        mutates = bool(info.mutated_args or info.mutated_kwargs)
        if mutates and not info.from_storage:
            # (set_ changes which memory a tensor shows, not the memory's bytes)
            for t in outputs:
                self.note_write(t)
        if info.aux or info.partly_written or info.comm or info.uninit_output \
                or info.from_storage or garbage_moved:
            self.underived += 1  # outputs not derived from inputs (kernels.py)
        if info.aux:  # never hashed nor compared (optable.AUX_OUTPUTS)
            aux = aux_tensors(out, info.aux)
            outputs = [t for t in outputs if not any(t is a for a in aux)]
            for t in aux:
                self.remember(t, Fp(value=0))
        if info.partly_written:  # garbage outside the part written (optable.PARTLY_WRITTEN)
            partly = aux_tensors(out, info.partly_written)
            outputs = [t for t in outputs if not any(t is a for a in partly)]
            for t in partly:
                self.remember(t, Fp(uninit=True))
        out_fps: list[Fp] = []
        if info.comm:  # still being written until the work's wait: read later (comm.py)
            written_by = comm.ENTRY_PREFIX + str(func)
            unset = set() if bucket else {
                id(t) for t in comm.tensors_deep((args, tuple(kwargs.values()), out))
                if (hit := self.entry(t)) is not None and hit[4].uninit}
            for t in comm.tensors_deep((args, tuple(kwargs.values()), out)):
                self.note_write(t)
                self.written_elsewhere(t, written_by)
            outputs = []
            # out_fps is the record's own list: filled in when the script waits (comm.py)
            self.collectives.launch(str(func), args, kwargs, out, out_fps, bucket, unset)
        elif info.uninit_output or garbage_moved:
            for t in outputs:
                self.remember(t, Fp(uninit=True))
        elif info.from_storage:
            self._wrapped_storage(outputs, None if info.storage_handle else known_source,
                                  None if info.storage_handle else ctx)
        else:
            # derived or hashed: remembered here, written ones settled at the next call
            # (what ``remember`` and ``wrote`` do, without looking the entries up again)
            derived = info.pointwise and not (info.move
                                              and cuda.crosses_devices(args, outputs))
            if outputs and not derived:
                self.underived += 1  # hashed (kernels.py)
            parents = ins + taints
            settling = self.settling if mutates else None
            for t in outputs:
                fp = (self.derive_output(info, parents, scalars, t) if derived
                      else self.fingerprint(t))
                out_fps.append(fp)
                if self.window:
                    entry = self.remember_entry(t, fp)
                    if settling is not None:
                        settling.append((entry, entry[1] + 1))
            mutates = False
        if not outputs and isinstance(out, (bool, int, float, complex)):
            out_fps.append(Fp(value=scalar_value(out)))  # .item() and friends
        if mutates:
            self.wrote(outputs)
        if needs_grad and (phase != _BACKWARD or self.backend.forward_in_backward_at is not None):
            # Not gated on grad mode: a custom op's autograd Function runs its forward with
            # grad mode off, yet its output gets a grad_fn afterwards.
            self.stamp = (outputs, module, source)
        numel = 0
        if outputs:
            first = outputs[0]
            numel = safe.numel(first)
            if not first.is_cpu:
                device = first.device.type
                flags |= Flag.CUDA if device == "cuda" else Flag.OTHER_DEVICE
        measured = info.measured and not garbage_moved
        if snap:  # after its outputs were hashed: a write until then is not the op's
            shared.check_own_write(self, func, info, args, kwargs, snap)
        self.add(_OP, phase, flags, info.name_id, module, source, out_fps, ins, taints,
                 tuple(scalars), numel, outputs if measured else [])
        return out

    def _view(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              ctx: tuple[int, int, int]) -> Any:
        """A view op: no record; its output's fingerprint is derived from its base's
        (Note [Derived fingerprints] in cache.py), the inputs it reads looked up (entry
        points recorded) without materializing a lazy one."""
        cached = None if self.shared_is_volatile else self.cached
        fps = []
        for value in (*args, *kwargs.values()) if kwargs else args:
            kind = type(value)
            if kind is _TENSOR or kind is _PARAMETER:
                fp = cached(value) if cached is not None else None
                fps.append(fp if fp is not None else self.lookup(value, ctx,
                                                                 materialize=False))
            elif kind is not int and value is not None:
                fps.extend(self.lookup(t, ctx, materialize=False) for t in tensors_in(value))
        out = self.run_op(func, args, kwargs)
        base = args[0] if args and isinstance(args[0], torch.Tensor) else None
        uninit = any(fp.uninit for fp in fps)
        if self.window and type(out) is _TENSOR:
            entry = self.remember_entry(out, self.derive(fps[0], base, out, uninit)
                                        if base is not None else Fp(uninit=uninit))
            if type(base) is _TENSOR or type(base) is _PARAMETER:
                # Note [Views share their base's version]: settled at the next call
                try:
                    version = base._version
                except (RuntimeError, NotImplementedError, AttributeError, TypeError):
                    return out  # no version counter (an inference tensor): not settled
                if version != entry[1]:
                    self.settling.append((entry, version))
            return out
        for t in tensors_in(out):
            fp = self.derive(fps[0], base, t, uninit) if base is not None else Fp(
                uninit=uninit)
            self.remember(t, fp)
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
            if not overwritten and not self.shared_is_volatile:
                # The common case first: a tensor whose current fingerprint is cached (what
                # ``lookup`` then returns, and the loop below appends to ``ins``).
                entry = self.cache.get(id(value))
                if entry is not None and entry[0]() is value:
                    fp = entry[4]
                    if (not fp.uninit and (fp.value is not None or not fp.lazy)
                            and (self.plain_current(value, entry)
                                 or self.current(value, entry))):
                        ins.append(fp)
                        return 0
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

    def _comm_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                     bucket: bool) -> list[Fp]:
        """A collective's tensors, fingerprinted now, never from the cache: the reducer
        copies gradients into its buckets in C++, unseen by the cache. Memory known to be
        uninitialized (a receive buffer from ``torch.empty``) is left out, except in a DDP
        bucket: the cache saw it made by ``empty`` but not filled (in C++) with gradients."""
        fps = []
        for t in comm.tensors_deep((args, tuple(kwargs.values()))):
            hit = self.entry(t)
            if hit is not None and hit[4].uninit and not bucket:
                continue
            fps.append(self.fingerprint(t))
        return fps

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
                meta: dict[str, Any] = node.metadata
                if "nondet" not in meta:
                    meta["nondet"] = (module, source)


def _extend_unique(outputs: list[torch.Tensor], value: Any) -> None:
    for t in tensors_in(value):
        if not any(t is o for o in outputs):
            outputs.append(t)


_autograd_node = torch._C._current_autograd_node
_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_BACKWARD = int(Phase.BACKWARD)
_OP = Kind.OP

#: Op namespaces that compute nothing (profiler ranges): not recorded.
_PASS_THROUGH = frozenset({"profiler"})


class CaptureMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
    """Records every dispatched op while op-level capture is on (see the module docstring).

    The recorder decides what is recorded; when it is inactive (outside the op window, or
    while nondet fingerprints step-level state) ops pass straight through.

    Note [Errors in the recorder]
    A hook must never raise into the script. The recorder marks how far the op got
    (``op_state``): an exception while the op itself runs is the script's (a shape
    mismatch, an out-of-memory error) and propagates unchanged; any other is nondet's own:
    the backend reports it (``hook_failed``: exit 3 with a log, capture off) and the script
    gets the op's result, the op run once, never twice (in-place ops).
    """

    #: torch.cond, torch.while_loop and the like reach __torch_dispatch__ whole
    supports_higher_order_operators = True

    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.recorder = recorder

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Lets Dynamo compile while the mode is on (else it runs the script eager and skips
        # the code for good): compiled regions are recorded whole by torch/compiled.py.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if (not self.recorder.active or func.namespace in _PASS_THROUGH or in_region()
                or dispatch_mode(FAKE) is not None):
            # (fake tensors: ``torch.export`` or a compiler tracing shapes, not a computation;
            # reading their sizes would specialize a dynamic dimension, and failed the export)
            return func(*args, **kwargs)
        recorder = self.recorder
        recorder.op_state = OP_PENDING
        try:
            if cuda.capturing():  # Note [CUDA graphs] in cuda.py
                return cuda.pass_captured(recorder, func, args, kwargs)
            return recorder.dispatch(func, args, kwargs)
        except Exception as exc:
            if recorder.op_state == OP_RUNNING or raised_by_script(exc, recorder.session.sources):
                raise  # the op's own error (a shape mismatch...), or the script's signal
                # handler's (base.raised_by_script): the script's to see
            # nondet's own: reported once as nondet's (exit 3), capture stops, the op's
            # result goes back to the script as if nondet had not been there
            state, out = recorder.op_state, recorder.op_out
            recorder.backend.hook_failed()
            return out if state == OP_DONE else func(*args, **kwargs)
        finally:
            recorder.op_out = None  # the script's tensor, not nondet's to keep alive
