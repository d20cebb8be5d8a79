"""Reading user tensors from inside the user's program, and telling their storages apart.

Note [Reading user tensors]
The op recorder runs inside the user's program, on every tensor the program makes. Some
of torch's own attribute reads raise on perfectly valid tensors: ``grad_fn`` of a view made
under ``no_grad`` whose base was then modified in place (``nn.Embedding(padding_idx=...)``,
``nn.init.orthogonal_``, Adam on a complex parameter through ``view_as_real``), ``_version``
of an inference tensor, ``untyped_storage()`` of sparse, nested and opaque (mkldnn) tensors,
``stride()`` of sparse CSR and nested tensors, integer sizes of jagged nested tensors. A
raise there would surface in the user's program as *its* error. So the recorder reads these
attributes only through the functions below, which return a neutral value instead; what is
unreadable is recorded as having no information (never as a difference).

Note [Storage identity]
Whether a record is written (an entry point for a tensor over memory nondet never saw, an
uninitialized value that must not be compared) depends on what nondet knows about a
tensor's storage. That knowledge must not depend on addresses: a storage freed and a new
one allocated at the same address is a different storage, and whether the allocator reuses
the address differs from run to run, so keying by address made one run record an entry the
other did not (a "structure" difference on a deterministic script). Storages are therefore
keyed by the identity of their Python object, which torch keeps alive exactly as long as
the storage itself (PyObject preservation): ``Storages`` holds a weak reference to it,
drops the state when it dies, and never matches a different object with a recycled
``id()``. Tensors without a storage (sparse, nested, opaque) are their own owner.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from nondet.fingerprint import name_code
from nondet.frameworks.torch.leaves import storage_owner

# Note [Methods the script replaces]
# A script may replace torch's tensor methods while it trains: one that bans host syncs in
# its loop makes ``Tensor.item``, ``tolist`` and ``numpy`` raise. nondet's own reads at a
# step's end went through the replaced methods and failed (exit 3, "nondet's hooks failed")
# where the plain script ran. nondet reads through torch's own methods, kept here when
# nondet's torch backend is imported, before any script code has run.
_ITEM = torch._C.TensorBase.item
_TOLIST = torch._C.TensorBase.tolist
_NUMPY = torch._C.TensorBase.numpy


#: the script's (or a compiler's) FakeTensorMode, if one is on: ``dispatch_mode(FAKE)``
dispatch_mode = torch._C._get_dispatch_mode
FAKE = torch._C._TorchDispatchModeKey.FAKE


def faking() -> bool:
    """Note [The script's fake tensors]
    A ``FakeTensorMode`` of the script's is on: a dry run for shapes or memory (a model-size
    estimate before training), where nothing is computed and no value can be read. Its
    module calls, backwards and optimizer steps are not training: nondet's hooks let them
    pass, as they do a CUDA graph's capture. Taken for training, the first model call
    started the run's first step and read state under the fake mode (exit 3, "hooks
    failed: DataDependentOutputException"). Not asked while Dynamo traces (it fakes
    tensors itself; the hooks check ``is_compiling`` for that first)."""
    return not torch.compiler.is_compiling() and dispatch_mode(FAKE) is not None


def item(t: torch.Tensor) -> Any:
    """``t.item()`` through torch's own method (Note [Methods the script replaces])."""
    return _ITEM(t)


def tolist(t: torch.Tensor) -> Any:
    """``t.tolist()`` through torch's own method (Note [Methods the script replaces])."""
    return _TOLIST(t)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """``t.numpy()`` through torch's own method (Note [Methods the script replaces])."""
    array: np.ndarray = _NUMPY(t)
    return array


#: What torch raises when an attribute does not apply to a tensor (see the Note). Anything
#: else is a bug in nondet and is left to the backend's containment.
_REFUSED = (RuntimeError, NotImplementedError, AttributeError, TypeError)
_NO_SHAPE = 0x5_4A9E  # stands for sizes that are not plain integers (nested tensors)
_DTYPE_CODES: dict[Any, int] = {}


def grad_fn(t: torch.Tensor) -> Any | None:
    """The autograd node of ``t``, or None (also when torch refuses to say)."""
    try:
        return t.grad_fn
    except _REFUSED:
        return None


def version(t: torch.Tensor) -> int | None:
    """The version counter, or None for tensors without one (inference tensors)."""
    try:
        return int(t._version)
    except _REFUSED:
        return None


def owner(t: torch.Tensor) -> object:
    """The object whose identity stands for ``t``'s memory (Note [Storage identity])."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        t = storage_owner(t)  # a wrapper subclass (DTensor): where its data lives
    try:
        return t.untyped_storage()
    except _REFUSED:
        return t


_CPU_CODE = name_code("cpu")


def describe(t: torch.Tensor) -> tuple[int, ...]:
    """dtype, device, rank and sizes as integers (sizes replaced by a marker if ragged, or
    for a 0-dim tensor)."""
    code = _DTYPE_CODES.get(t.dtype)
    if code is None:
        code = _DTYPE_CODES[t.dtype] = name_code(str(t.dtype))
    kind = type(t)
    if (kind is torch.Tensor or kind is torch.nn.Parameter) and t.is_cpu and not t.is_nested:
        # the common case, read directly: a plain dense tensor's sizes are ints
        return (code, _CPU_CODE, t.dim(), *(t.shape or (_NO_SHAPE,)))
    sizes = shape(t)
    return (code, name_code(t.device.type), t.dim(), *(sizes or (_NO_SHAPE,)))


def shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """The sizes as integers, or None if they are not: nested tensors, and symbolic sizes
    (``torch.export`` with a dynamic dimension: ``int()`` of a symbolic size would fix the
    dimension to the example's, and the export failed under nondet)."""
    try:
        sizes = t.shape
        if not all(type(n) is int for n in sizes):
            return None
        return tuple(sizes)
    except _REFUSED:
        return None


def geometry(view: torch.Tensor, base: torch.Tensor) -> tuple[int, ...] | None:
    """A view's strides and offset relative to its base, or None if it has none."""
    try:
        return (*(int(n) for n in view.stride()),
                int(view.storage_offset()) - int(base.storage_offset()))
    except _REFUSED:
        return None


def numel(t: torch.Tensor) -> int:
    try:
        return int(t.numel())
    except _REFUSED:
        return 0


def readable(t: torch.Tensor) -> bool:
    """False for layouts whose bytes the hasher cannot read as one tensor (nested)."""
    return not t.is_nested


#: dtypes whose values the backend can copy into NumPy (after widening fp8/bf16/fp16 and
#: complex32): quantized, bits, sub-byte and fp4 types have no NumPy counterpart.
_KEEPABLE = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
    torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex32, torch.complex64, torch.complex128, torch.float8_e4m3fn,
    torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
})


def keepable(t: torch.Tensor) -> bool:
    """Whether a host copy of ``t``'s values can be kept (plain dense or sparse tensors)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in _KEEPABLE
            and not t.is_nested and t.device.type != "meta"
            and t.layout in (torch.strided, torch.sparse_coo))


class StorageState(weakref.ref):  # type: ignore[type-arg]
    """What the recorder knows about one storage during an op window: a weak reference to
    the storage object (one allocation per storage: the op recorder makes one for nearly
    every op output), with the recorder's marks."""

    __slots__ = ("key", "origin", "uninit", "writes")

    def __init__(self, storage: object, callback: Any = None) -> None:
        # (weakref.ref.__new__ took the referent and the callback)
        self.key = id(storage)
        self.writes = 0  # recorded ops that wrote any tensor on it
        self.uninit: bool | None = None  # None: no tensor on it seen; True: garbage
        # (phase, module, source) of the ``set_`` that wrapped it while its contents were
        # unknown: an entry point if it is read before being written (Note [Uninitialized
        # memory] in ops.py).
        self.origin: tuple[int, int, int] | None = None


class _Nobody:
    """Stands in for a storage that cannot be weakly referenced: its state is known for one
    use only, and matches no tensor's storage."""


_NOBODY = _Nobody()


class Storages:
    """Per-storage state keyed by storage identity, never by address (see the Note)."""

    def __init__(self) -> None:
        self._states: dict[int, StorageState] = {}
        self._drop = self._dropped  # one bound method for every state's callback

    def get(self, t: torch.Tensor) -> StorageState | None:
        return self.get_object(owner(t))

    def get_object(self, obj: object) -> StorageState | None:
        state = self._states.get(id(obj))
        if state is None or state() is not obj:
            return None
        return state

    def state(self, t: torch.Tensor) -> StorageState:
        """The state of ``t``'s storage, created empty on first sight."""
        return self.state_of(owner(t))

    def state_of(self, obj: object) -> StorageState:
        """The state of the storage object ``obj`` (``owner``), created on first sight."""
        state = self._states.get(id(obj))
        if state is not None and state() is obj:
            return state
        try:
            state = StorageState(obj, self._drop)
        except TypeError:  # not weakly referenceable: known for this use only
            return StorageState(_NOBODY)
        self._states[state.key] = state
        return state

    def _dropped(self, state: StorageState) -> None:
        if self._states.get(state.key) is state:
            del self._states[state.key]

    def clear(self) -> None:
        self._states = {}

    def __len__(self) -> int:
        return len(self._states)
