"""What the PyTorch op recorder remembers during a captured step: the fingerprint of
every tensor it has seen (the cache), fingerprints still on their device (resolved once
per step), and (steprecords.py) the step's records. The per-op logic is ``ops.py``.

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

Note [Version bumps after the op]
An in-place op bumps its written tensors' version counters in autograd's ADInplaceOrView
kernel, which runs *above* the Python dispatch key: after the recorder has returned. Taken
at face value, every tensor an op wrote would look changed-outside-the-ops at its next
read and be hashed again (86 times per step on the narrow benchmark model: parameters,
Adam moments and steps, batch-norm statistics). So the entries of tensors an op wrote are
*settled* at the next recorder call (the next op, or a cache query from the backend): a
version counter then one ahead of the entry's (the bump; nothing else ran in between but
the return through the dispatcher) is taken as the entry's version, if the storage object
and its write count are still the entry's. Any other change leaves the entry stale, so the
tensor is hashed again: settling can only save a hash, never keep one that changed.

Note [Views share their base's version]
An out-of-place view op's output (``t``, ``detach``, ``view``) shares its base's version
counter only once the ADInplaceOrView kernel has run, above the recorder as well: inside
the recorder it reads 0. Its entry (a derived fingerprint) would then be stale at its first
read whenever the base's version is not 0 (every parameter the optimizer has written: the
transposed weights a linear layer's backward reads), and the view hashed again. So a view's
entry is settled like a written tensor's, expecting the base's version at the view op: it
keeps its derived fingerprint if the view then reads exactly that version, over the same
storage object with no recorded write since. A read of such a view records the derived
value where it recorded the view's content hash before (fingerprint scheme 3).
"""

from __future__ import annotations

import hashlib
import struct
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from nondet.channel import CHILD_ENTRY_PREFIX
from nondet.fingerprint import MASK64, combine_packed, pack_words, scalar_value
from nondet.frameworks.fp import Fp
from nondet.frameworks.torch import cuda
from nondet.frameworks.torch import tensors as safe
from nondet.frameworks.torch.hostwords import StateViews
from nondet.frameworks.torch.optable import OpInfo
from nondet.frameworks.torch.readback import read_back
from nondet.frameworks.torch.shared import fold, in_shared_memory
from nondet.frameworks.torch.steprecords import StepRecords, TorchHost
from nondet.frameworks.torch.tensors import Storages, StorageState
from nondet.records import Kind

_VIEW_TAG = 0x71E3_5EED
_describe = safe.describe
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
#: What torch raises reading an attribute that does not apply (Note [Reading user tensors])
_REFUSED = (RuntimeError, NotImplementedError, AttributeError, TypeError)
#: A cache entry: the tensor (weakly), its version counter (-1: none) and storage state
#: when the fingerprint was taken, the storage's write count then, the fingerprint.
Entry = tuple[weakref.ref[torch.Tensor], int, StorageState, int, Fp]
_blake2b = hashlib.blake2b
#: describe() of plain dense CPU tensors by (dtype, sizes), with its packed words: a step
#: makes the same few shapes again and again. Capped: a script may make endless shapes.
_CPU_META: dict[tuple[Any, Any], tuple[tuple[int, ...], bytes]] = {}


def _cpu_meta(t: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    """``describe(t)`` of a plain CPU tensor, and the same words packed as ``combine``
    packs them."""
    key = (t.dtype, t.shape)
    known = _CPU_META.get(key)
    if known is None:
        meta = _describe(t)
        known = meta, struct.pack(f"<{len(meta)}Q", *(m & MASK64 for m in meta))
        if len(_CPU_META) < 4096:
            _CPU_META[key] = known
    return known


# Note [Packed descriptions]
# A derived fingerprint is ``combine((*parent values, *description))`` (Fp.finalize); a
# step derives ~150 of them on the narrow benchmark model, mostly from the same few (op,
# dtype, shape) descriptions. ``combine`` of a concatenation is the hash of the
# concatenated packed words (fingerprint.pack_words), so the description is packed once
# per (op, dtype, shape) and the parents' values are packed directly: the same value,
# about 1.4 us less per derived record than building and packing the whole tuple.
_OUT_META: dict[tuple[int, Any, Any], tuple[tuple[int, ...], bytes]] = {}
_PARENT_PACKERS = {1: struct.Struct("<Q"), 2: struct.Struct("<2Q"), 3: struct.Struct("<3Q")}


def _out_meta(code: int, t: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    """``(code, *describe(t))`` of a plain CPU tensor, and the same words packed."""
    key = (code, t.dtype, t.shape)
    known = _OUT_META.get(key)
    if known is None:
        meta = (code, *_cpu_meta(t)[0])
        known = meta, pack_words(meta)
        if len(_OUT_META) < 4096:
            _OUT_META[key] = known
    return known


#: A view's description (Fp.meta of a derived view fingerprint) and its packed words, by
#: (dtype, sizes, strides, offset from the base): a step makes the same views each time.
_VIEW_META: dict[tuple[Any, ...], tuple[tuple[int, ...], bytes]] = {}


def _view_meta(view: torch.Tensor, stride: tuple[int, ...], offset: int
               ) -> tuple[tuple[int, ...], bytes]:
    """``(_VIEW_TAG, *describe(view), *stride, offset)`` of a plain CPU view, and the same
    words packed (Note [Packed descriptions])."""
    key = (view.dtype, view.shape, stride, offset)
    known = _VIEW_META.get(key)
    if known is None:
        meta = (_VIEW_TAG, *_cpu_meta(view)[0], *stride, offset)
        known = meta, pack_words(meta)
        if len(_VIEW_META) < 4096:
            _VIEW_META[key] = known
    return known


def _pack_parents(parents: tuple[Fp, ...]) -> bytes:
    """The parents' final values as ``pack_words`` packs them."""
    packer = _PARENT_PACKERS.get(len(parents))
    if packer is None:
        return pack_words([p.value or 0 for p in parents])
    return packer.pack(*[(p.value or 0) & MASK64 for p in parents])


def _owner_and_version(t: torch.Tensor) -> tuple[object, int]:
    """The object standing for ``t``'s memory (Note [Storage identity]) and its version
    counter (-1 for tensors without one): read directly for plain tensors."""
    if type(t) in _PLAIN_TYPES:
        try:
            return t.untyped_storage(), t._version
        except _REFUSED:
            pass  # an inference or sparse tensor: the guarded reads below
    version = safe.version(t)
    return safe.owner(t), -1 if version is None else version



#: ``FingerprintCache.op_state`` values
OP_PENDING, OP_RUNNING, OP_DONE = 0, 1, 2

class FingerprintCache(StepRecords):
    """Fingerprint cache, pending device values and (``StepRecords``) the current step's
    records: the state ``ops.OpRecorder`` works on."""

    def __init__(self, backend: TorchHost) -> None:
        super().__init__(backend)
        self.hasher = backend.hasher
        self.window = False  # op-level capture is on for the current step
        self.active = False  # ... and nondet is not running its own ops right now
        self.cache: dict[int, Entry] = {}
        #: entries to settle at the next recorder call, with the version each expects
        #: (Note [Version bumps after the op])
        self.settling: list[tuple[Entry, int]] = []
        self.storages = Storages()  # Note [Storage identity]
        self.pending: list[Fp] = []
        self.graph_outputs = cuda.GraphOutputs(self.forget)  # written by captured ops
        self.infos: dict[Any, OpInfo] = {}
        self.infos_by_id: dict[int, tuple[Any, OpInfo]] = {}  # ops.py: id(func) -> (func, info)
        self.stamp: tuple[list[torch.Tensor], int, int] | None = None
        self.creating: tuple[str, str] | None = None  # entry label while a wrapper runs
        # tensors written where this process records no op (a collective, "comm:<op>",
        # frameworks/torch/comm.py; a joined child process, "child:<K>", children.py), read
        # afresh by their first reader: its entry is named after the writer
        self.outside_writers: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self.depth = 0  # > 0 while an op's own implementation runs (custom ops in Python)
        #: how far the op of the dispatch under way got (Note [Errors in the recorder] in
        #: ops.py): OP_PENDING, OP_RUNNING (an exception now is the op's own) or OP_DONE
        #: (its output in ``op_out``, for the case where nondet fails after it)
        self.op_state = OP_PENDING
        self.op_out: Any = None
        self.unnamed_entries: dict[tuple[Any, tuple[int, ...] | None], int] = {}
        #: A child process the script started (children.py): memory it shares with other
        #: processes (Hogwild weights) may be written by them at any moment, unseen by this
        #: process's version counters, so every read of it is an entry, hashed afresh,
        #: and hashed again after the op (Note [Writes during an op] in shared.py).
        self.shared_is_volatile = False
        self.rereads: list[tuple[Fp, Fp]] = []  # (before, after) still on a device
        #: ops recorded so far whose outputs were not derived from their inputs (hashed,
        #: uninitialized, wrapped, a collective's): kernels.py checks a kernel's first call
        self.underived = 0

    # -- fingerprints -----------------------------------------------------------------------

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the op itself, marking how far it got (Note [Errors in the recorder])."""
        self.op_state = OP_RUNNING
        out = func(*args, **kwargs)
        self.op_state, self.op_out = OP_DONE, out
        return out

    def fingerprint(self, t: torch.Tensor, fp: Fp | None = None) -> Fp:
        """Start fingerprinting ``t`` (into ``fp`` if given, e.g. a lazy one)."""
        fp = fp or Fp()
        content = self.hasher.content(t) if safe.readable(t) else None
        if content is None:
            fp.value = 0  # unhashable: compared as "no information"
        elif type(content) is int and type(t) in _PLAIN_TYPES:
            # On the host already (a CPU tensor): the final value now, as Fp.finalize
            # would compute it at the step end, with the description packed once per shape.
            packed = _cpu_meta(t)[1]
            fp.value = int.from_bytes(_blake2b(content.to_bytes(8, "little") + packed,
                                               digest_size=8).digest(), "little") or 1
        else:
            fp.content = content
            fp.meta = _describe(t)
            self.pending.append(fp)
        return fp

    def fingerprint_many(self, tensors: list[torch.Tensor],
                         views: StateViews | None = None) -> list[Fp]:
        """One fingerprint for a group of tensors (per device): their words concatenated.
        ``views``: the group's word views kept across steps (parameters, buffers, optimizer
        state; hostwords.StateViews)."""
        contents = self.hasher.content_of_many(tensors, views=views).values()
        packed = views.packed_meta(len(tensors)) if views is not None else None
        if packed is not None and len(contents) == 1:
            (content,) = contents
            if type(content) is int:
                # Every tensor is a plain CPU one, read on the host: the final value now,
                # as Fp.finalize would compute it, with the descriptions packed once
                # (kept with the views while they are reused).
                fp = Fp()
                fp.value = int.from_bytes(_blake2b(content.to_bytes(8, "little") + packed,
                                                   digest_size=8).digest(), "little") or 1
                return [fp]
        meta = views.meta(len(tensors)) if views is not None else None  # kept descriptions
        if meta is None:
            meta = tuple(x for t in tensors for x in _describe(t))
        fps = []
        for content in contents:
            fp = Fp()
            fp.content, fp.meta = content, meta
            self.pending.append(fp)
            fps.append(fp)
        return fps

    def derive(self, base: Fp, base_tensor: torch.Tensor, view: torch.Tensor,
               uninit: bool) -> Fp:
        """A view's fingerprint from its base's (see ``Fp``); lazy if the base is lazy, or
        holds uninitialized memory: a view may show only the part written (``k =
        torch.empty(n, 3)``, two columns filled, ``k[:, :2]`` read), so a read of it hashes
        the view itself. Derived from the whole base, its garbage column made the reading
        op differ between the runs ("reads uninitialized memory": a false finding, which
        hid the real one behind it)."""
        fp = Fp(uninit=uninit)
        if base.lazy or uninit:
            return fp
        if type(view) in _PLAIN_TYPES and view.is_cpu and not view.is_nested:
            try:  # a strided CPU view (sparse and opaque ones refuse: the general path)
                stride = view.stride()
                offset = int(view.storage_offset() - base_tensor.storage_offset())
            except _REFUSED:
                pass
            else:
                fp.parents = (base,)
                fp.meta, packed = _view_meta(view, stride, offset)
                return self._derived(fp, packed)
        where = safe.geometry(view, base_tensor)
        if where is None:  # no strides (sparse, nested): read the view itself
            return self.fingerprint(view, fp)
        fp.parents = (base,)
        fp.meta = (_VIEW_TAG, *_describe(view), *where)
        return self._derived(fp)

    def derive_output(self, info: OpInfo, inputs: list[Fp], scalars: list[Any],
                      out: torch.Tensor) -> Fp:
        """A pointwise op's output fingerprint from its inputs' (Note [Derived fingerprints])."""
        fp = Fp()
        fp.parents = tuple(inputs)
        if type(out) in _PLAIN_TYPES and out.is_cpu and not out.is_nested:
            meta, packed = _out_meta(info.code, out)
        else:
            meta, packed = (info.code, *_describe(out)), None
        if scalars:
            values = [scalar_value(x) for x in scalars]
            meta = (*meta, *values)
            if packed is not None:
                packed += pack_words(values)
        fp.meta = meta
        return self._derived(fp, packed)

    def _derived(self, fp: Fp, packed: bytes | None = None) -> Fp:
        """A derived fingerprint: final now if its parents are (what ``Fp.finalize`` would
        compute at the step end), else pending until they are. ``packed``: ``fp.meta``
        already packed (``pack_words``), saving its packing per record (Note [Packed
        descriptions])."""
        parents = fp.parents
        assert parents is not None
        for parent in parents:
            if parent.value is None:
                self.pending.append(fp)
                return fp
        if packed is None:
            fp.finalize()
        else:  # Fp.finalize's value: combine((*parent values, *meta))
            fp.value = combine_packed(_pack_parents(parents) + packed)
            fp.parents = None
        return fp

    # -- the cache (see Note [Fingerprint cache]) -------------------------------------------
    def open_window(self) -> None:
        self.close_window()
        self.threads.claim()
        self.window = self.active = True

    def close_window(self) -> None:
        self.window = self.active = False
        self.cache = {}
        self.settling = []
        self.storages.clear()
        self.stamp = None

    def note_write(self, t: torch.Tensor) -> None:
        state = self.storages.state(t)
        state.writes += 1
        state.origin = None  # written by a recorded op: no longer an unknown storage

    def remember(self, t: torch.Tensor, fp: Fp) -> Fp:
        if self.window:
            self.remember_entry(t, fp)
        return fp

    def remember_entry(self, t: torch.Tensor, fp: Fp) -> Entry:
        """``remember`` in the op window, returning the entry (``wrote`` takes it)."""
        if type(t) in _PLAIN_TYPES:  # _owner_and_version's common case, inline
            try:
                obj: object = t.untyped_storage()
                version = t._version
            except _REFUSED:  # an inference or sparse tensor
                obj, version = _owner_and_version(t)
        else:
            obj, version = _owner_and_version(t)
        state = self.storages.state_of(obj)
        entry = (weakref.ref(t), version, state, state.writes, fp)
        self.cache[id(t)] = entry
        state.uninit = fp.uninit
        return entry

    def wrote(self, tensors: list[torch.Tensor]) -> None:
        """``tensors`` were written by the op just recorded: their entries are settled at
        the next recorder call (Note [Version bumps after the op])."""
        for t in tensors:
            entry = self.cache.get(id(t))
            if entry is not None and entry[0]() is t:
                self.settling.append((entry, entry[1] + 1))

    def cached(self, t: torch.Tensor) -> Fp | None:
        """The cached fingerprint of a plain tensor whose entry is current (lazy or not),
        read inline: the hot path of every op input. None: ask ``lookup``."""
        entry = self.cache.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        state = entry[2]
        if state.writes != entry[3] or type(t) not in _PLAIN_TYPES:
            return None
        try:
            if t._version == entry[1] and state() is t.untyped_storage():
                return entry[4]
        except _REFUSED:
            pass  # an inference or sparse tensor: ``lookup`` decides
        return None

    def settle(self) -> None:
        """Take the version bumps of the last op's written tensors into their entries."""
        settling, self.settling = self.settling, []
        for entry, expected in settling:
            t = entry[0]()
            if t is None or self.cache.get(id(t)) is not entry:
                continue  # gone, or remembered anew since
            obj, version = _owner_and_version(t)
            state = entry[2]
            if version == expected and state() is obj and state.writes == entry[3]:
                self.cache[id(t)] = (entry[0], version, state, entry[3], entry[4])

    def entry(self, t: torch.Tensor) -> Entry | None:
        """The cache entry of ``t`` (current or not), never one of a recycled ``id``."""
        entry = self.cache.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry

    @staticmethod
    def plain_current(t: torch.Tensor, entry: Entry) -> bool:
        """``current`` for a plain tensor, read inline (the hot path of every op input);
        False also where it cannot tell (other tensor types): ask ``current`` then."""
        state = entry[2]
        if state.writes != entry[3] or type(t) not in _PLAIN_TYPES:
            return False
        try:
            return t._version == entry[1] and state() is t.untyped_storage()
        except _REFUSED:
            return False  # an inference or sparse tensor: ``current`` decides

    @staticmethod
    def current(t: torch.Tensor, entry: Entry) -> bool:
        """``entry`` (``t``'s) is exact still: the same version counter, the same storage
        object, and no recorded write to that storage since (Note [Fingerprint cache])."""
        state = entry[2]
        if state.writes != entry[3]:
            return False
        obj, version = _owner_and_version(t)
        return version == entry[1] and state() is obj

    def prune(self) -> None:
        """Drop cache entries of tensors that no longer exist."""
        self.cache = {k: e for k, e in self.cache.items() if e[0]() is not None}
        self.outside_writers = {k: e for k, e in self.outside_writers.items() if e[0]() is not None}

    def written_elsewhere(self, t: torch.Tensor, writer: str) -> None:
        """``t`` may have been written where no op was recorded: its next read is an entry
        named ``writer``, hashed afresh."""
        self.forget(t)
        self.outside_writers[id(t)] = (weakref.ref(t), writer)

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
        if self.settling:
            self.settle()
        entry = self.entry(t)
        if entry is None or not self.current(t, entry):
            return None
        fp = entry[4]
        if fp.lazy:
            self.fingerprint(t, fp)
        return fp

    def lookup(self, t: torch.Tensor, ctx: tuple[int, int, int], materialize: bool = True) -> Fp:
        """Fingerprint of an op input; records an entry point for a tensor never seen."""
        if self.settling:
            self.settle()
        if self.shared_is_volatile and in_shared_memory(t):
            self.forget(t)
        entry = self.entry(t)
        if entry is not None:
            fp = entry[4]
            if self.current(t, entry):
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
        writer = self.outside_writers.pop(id(t), None)
        written_by = writer[1] if writer is not None and writer[0]() is t else None
        if written_by is not None and not written_by.startswith(CHILD_ENTRY_PREFIX):
            return self.session.intern(written_by)  # a collective's output (collective.py)
        if self.creating is not None:
            kind, what = self.creating
            return self.session.intern(f"{kind}:{what}")
        name = self.backend.tensor_name(t) or self._view_name(t)
        if name:  # a parameter keeps its name, whoever wrote it
            return self.session.intern(f"external:{name}")
        if written_by is not None:  # an unnamed tensor a joined child left: "child:<K>"
            return self.session.intern(written_by)
        sizes = safe.shape(t)
        key = (t.dtype, sizes)
        sid = self.unnamed_entries.get(key)
        if sid is None:  # formatted once per dtype and shape (entries recur every step)
            dims = "[nested]" if sizes is None else str(list(sizes))
            sid = self.session.intern(f"external:tensor {str(t.dtype).removeprefix('torch.')}"
                                      f"{dims}")
            self.unnamed_entries[key] = sid
        return sid

    def _view_name(self, t: torch.Tensor) -> str | None:
        """"parameter 2.weight (a view)": a view of a named parameter (the transposed weight
        a backward op reads), so an entry there names what it views."""
        try:
            base = t._base
        except Exception:
            return None
        name = None if base is None else self.backend.tensor_name(base)
        return f"{name} (a view)" if name else None

    def resolve(self, floats: Sequence[torch.Tensor] = ()) -> list[float]:
        """Copy pending device sums (and ``floats``, float64 device scalars) to the host in
        one transfer per device (readback.py), then combine each fingerprint with its
        description. Bases precede their views in the list. Returns ``floats``' values."""
        on_device = [fp for fp in self.pending if isinstance(fp.content, torch.Tensor)]
        sums, values = read_back([fp.content for fp in on_device], floats)
        for fp, value in zip(on_device, sums, strict=True):
            fp.content = value
        for fp in self.pending:
            fp.finalize()
        self.pending = []
        if self.rereads:
            fold(self.rereads)
            self.rereads = []
        return values

