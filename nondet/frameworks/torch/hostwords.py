"""CPU tensors as NumPy word arrays for the host path of the content sum (hashing.py).

Note [Fingerprint definition] (nondet/fingerprint.py) reads a tensor's bytes as words; on
the CPU, ``np.dot`` of a zero-copy view of those words with the position keys computes the
sum without writing any products. Three ways in:

- ``dense_cpu_words``: a plain, dense, contiguous CPU tensor (what almost every op makes),
  with a few attribute reads instead of the general checks of ``leaves.data_leaves``
  (``dense_cpu_content``: its content sum at once, the op recorder's common case);
- ``host_words``: any prepared CPU tensor (sparse, complex128, non-contiguous copied);
- ``StateViews``: views of the step-level state (parameters, buffers, optimizer state),
  kept from one step to the next and reused while they are exactly the tensor's bytes.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import numpy as np
import torch

from nondet.fingerprint import host_content, pack_words, word_size
from nondet.frameworks.torch.tensors import describe, to_numpy

NP_WORDS = {8: np.int64, 4: np.int32, 1: np.uint8}


def zero_copy(t: torch.Tensor) -> bool:
    """``host_words`` reads ``t`` without copying it (so memory stays bounded)."""
    return t.layout == torch.strided and t.is_contiguous()


class _Memory:
    """An address range as NumPy's array interface (read-only bytes; owns nothing)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a uint8 array over its own memory, valid
    while ``t`` keeps that memory (the array does not hold it). Not ``t.numpy()``: that
    marks the storage as not resizable for good, so a later ``resize_`` in the user's
    script (a buffer grown in place) would raise there because nondet had hashed it."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    address = t.data_ptr()
    if not address:  # Note [Zero tensors]
        return np.zeros(nbytes, dtype=np.uint8)
    return np.asarray(_Memory(address, nbytes))


def dense_cpu_words(t: torch.Tensor) -> np.ndarray | None:
    """``host_words`` of a plain, dense, contiguous CPU tensor, or None for anything else:
    the same words as ``leaves.data_leaves`` + ``host_words`` give, without their general
    checks (about 20 us per tensor on the narrow benchmark model: the cost of a small op).
    Valid while ``t`` keeps its memory (``raw_bytes``)."""
    kind = type(t)
    if ((kind is not torch.Tensor and kind is not torch.nn.Parameter) or not t.is_cpu
            or t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_conj()
            or t.is_neg() or not t.is_contiguous()):
        return None
    try:
        return _word_array(t)
    except RuntimeError:  # a torch.func wrapper: no memory of its own (leaves.functorch_inner)
        return None


class _Words:
    """A contiguous CPU tensor's memory as NumPy's array interface, already in its word
    type (owns nothing)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, count: int, typestr: str) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": (count,),
                                    "typestr": typestr, "version": 3}


_TYPESTR = {8: "<i8", 4: "<i4", 1: "|u1"}


def dense_cpu_content(t: torch.Tensor) -> int | None:
    """``host_content([dense_cpu_words(t)])``, or None where ``dense_cpu_words`` is None:
    the op recorder's common case (a freshly made activation, gradient or optimizer
    state), with the word array made in one step."""
    kind = type(t)
    if ((kind is not torch.Tensor and kind is not torch.nn.Parameter) or not t.is_cpu
            or t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_conj()
            or t.is_neg() or not t.is_contiguous()):
        return None
    try:
        return host_content([_word_array(t)])
    except RuntimeError:  # a torch.func wrapper: no memory of its own (leaves.functorch_inner)
        return None


def _word_array(t: torch.Tensor) -> np.ndarray:
    """The words of a plain dense contiguous CPU tensor's memory, made in one NumPy call
    (``raw_bytes`` and a ``view`` are two): valid while ``t`` keeps that memory."""
    nbytes = t.nbytes
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    word = word_size(nbytes)
    address = t.data_ptr()
    if not address:
        # Note [Zero tensors]
        # Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) gives a zero
        # tangent as an efficient zero tensor: its values are all zero, and it has no
        # memory (``data_ptr()`` is 0; NumPy refused the address, a nondet error, exit 3).
        # Its words are zeros, as a tensor of zeros has.
        return np.zeros(nbytes // word, dtype=_TYPESTR[word])
    return np.asarray(_Words(address, nbytes // word, _TYPESTR[word]))


def host_words(t: torch.Tensor) -> np.ndarray:
    """The same words as ``TorchHasher.words`` as a NumPy array (prepared CPU tensors), in
    their narrow word type (``host_content`` widens them one chunk at a time, like the
    device path): a view of a contiguous tensor's memory, valid while ``t`` keeps it."""
    if t.layout == torch.sparse_coo:
        return np.concatenate([host_words(t._indices()), host_words(t._values())])
    if not t.is_contiguous():
        # small tensors only (see content_of_many); the array owns the copy
        raw = to_numpy(t.contiguous().view(torch.uint8)).reshape(-1)
    else:
        raw = raw_bytes(t)
    return raw.view(NP_WORDS[word_size(raw.size)])


#: A kept word view: (the tensor, weakly; its address, dtype and shape then; its words;
#: its describe())
_View = tuple["weakref.ref[torch.Tensor]", int, Any, Any, np.ndarray, tuple[int, ...]]


class StateViews:
    """Word views of step-level state tensors, reused across steps (one per group).

    Parameters, buffers and optimizer state are the same tensors, over the same memory, at
    every step: making their views anew costs more than hashing most of them (about 10 us
    per tensor, against a few for the checks below). A view is reused only while it is
    exactly the tensor's bytes: the same tensor object (a weak reference, never a recycled
    ``id``), at the same address, with the same dtype and shape, still contiguous (and for
    complex dtypes neither conjugate nor negative views). The view's address is fixed when
    it is made, so equal addresses mean it reads the tensor's current memory whatever
    happened to the storage in between. Views are dropped for tensors that leave the group;
    a view does not hold the memory it shows (``raw_bytes``) and is read only after those
    checks, while the tensor is alive. The group's descriptions are kept packed while
    every tensor keeps its view, in the same order (``packed_meta``).
    """

    def __init__(self) -> None:
        self._views: dict[int, _View] = {}  # by id of the tensor
        self._entries: list[_View] | None = None  # of the last call, in its order
        self._packed: bytes | None = None  # their descriptions packed, once

    def words(self, tensors: list[torch.Tensor]) -> list[np.ndarray | None]:
        """The words of each tensor (None: not a plain dense contiguous CPU tensor)."""
        old, new = self._views, {}
        out: list[np.ndarray | None] = []
        entries: list[_View] | None = []
        for t in tensors:
            key = id(t)
            entry = old.get(key)
            if (entry is not None and entry[0]() is t and t.is_cpu
                    and t.layout == torch.strided and t.data_ptr() == entry[1]
                    and t.dtype == entry[2] and t.shape == entry[3] and t.is_contiguous()
                    and not (t.is_complex() and (t.is_conj() or t.is_neg()))):
                new[key] = entry
                out.append(entry[4])
                if entries is not None:
                    entries.append(entry)
                continue
            words = dense_cpu_words(t)
            out.append(words)
            if words is None:
                entries = None  # described by the general path
                continue
            try:
                ref = weakref.ref(t)
            except TypeError:  # not weakly referenceable: not kept
                entries = None
                continue
            entry = (ref, t.data_ptr(), t.dtype, t.shape, words, describe(t))
            new[key] = entry
            if entries is not None:
                entries.append(entry)
        last = self._entries
        if (entries is None or last is None or len(entries) != len(last)
                or not all(map(operator.is_, entries, last))):
            self._packed = None  # other descriptions, or in another order
        self._views, self._entries = new, entries
        return out

    def meta(self, count: int) -> tuple[int, ...] | None:
        """``describe()`` of each tensor of the last ``words`` call (of ``count`` tensors),
        concatenated, or None where one of them is not a plain dense CPU tensor."""
        entries = self._entries
        if entries is None or len(entries) != count:
            return None
        return tuple(x for entry in entries for x in entry[5])

    def packed_meta(self, count: int) -> bytes | None:
        """``meta(count)`` packed as ``combine`` packs it (fingerprint.pack_words), kept
        while the group's tensors keep their views in the same order."""
        if self._packed is None:
            meta = self.meta(count)
            if meta is None:
                return None
            self._packed = pack_words(meta)
        return self._packed

    def clear(self) -> None:
        self._views, self._entries, self._packed = {}, None, None
