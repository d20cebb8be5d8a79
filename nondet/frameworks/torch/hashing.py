"""Tensor fingerprints: the content sum of Note [Fingerprint definition] for torch tensors.

Two implementations of the same number:

- on accelerators, torch ops on the tensor's own device (``_device_sum``): the result stays
  a 0-dim int64 tensor until the end of the step, when all of them are copied to the host
  in one transfer;
- on the CPU, for small tensors and for groups of step-level state, a zero-copy NumPy view
  and ``np.dot`` (``_host_sum``): exact integer arithmetic that wraps modulo 2**64 like the
  device path, without the overhead of several small torch calls or waking torch's OpenMP
  pool. It returns a Python int.

Tests force both paths on the same tensors and check that they agree.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from nondet.fingerprint import (
    CHUNK_WORDS,
    chunk_keys,
    host_content,
    position_keys,
    word_size,
)
from nondet.frameworks.torch import cuda
from nondet.frameworks.torch.hostwords import (
    StateViews,
    dense_cpu_content,
    dense_cpu_words,
    host_words,
    zero_copy,
)

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 1: torch.uint8}
#: Floating dtypes with sum/abs/max kernels on every device; others are widened for stats.
_REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# Taken before nondet wraps torch.from_numpy to see data entering the user's script.
_from_numpy = torch.from_numpy

Content = torch.Tensor | int
#: Non-contiguous CPU tensors above this many elements take the torch path (its staging
#: bounds the memory a copy would take); contiguous ones of any size are read zero-copy by
#: ``np.dot``, which writes no products: measured on the narrow benchmark model, it hashes
#: a freshly written 4 MB activation in about half the time of torch's multiply-then-sum
#: (single-threaded) and does not stall when other processes hold the cores.
HOST_LIMIT = 1 << 16
_CPU = torch.device("cpu")


class TorchHasher:
    """Computes content sums; keeps per-device keys and per-thread scratch buffers."""

    def __init__(self) -> None:
        self._keys: dict[torch.device, torch.Tensor] = {}
        self._chunk_keys: dict[torch.device, torch.Tensor] = {}
        self._local = threading.local()  # scratch per thread: autograd may run on other threads

    def content(self, tensor: torch.Tensor, *, on_device: bool = False) -> Content | None:
        """The content sum of ``tensor``, or None if it has no readable data.

        ``on_device=True`` forces the torch-op path on CPU tensors too (for tests).
        """
        if not on_device:
            value = dense_cpu_content(tensor)
            if value is not None:  # the common case, without the general machinery below
                return value
        leaves = _leaves(tensor)
        if leaves is None:
            return None
        device = leaves[0].device
        if any(t.device != device for t in leaves):
            return None  # a wrapper with parts on several devices: no single sum
        if device.type == "cpu" and not on_device and (
                sum(t.numel() for t in leaves) <= HOST_LIMIT
                or all(zero_copy(t) for t in leaves)):
            return host_content([host_words(t) for t in leaves])
        return self._device_sum([_word_pieces(t, self._stage(device)) for t in leaves], device)

    def content_of_many(self, tensors: Sequence[torch.Tensor], *, on_device: bool = False,
                        views: StateViews | None = None) -> dict[str, Content]:
        """Content sum of the concatenated words of ``tensors``, per device type.

        Used for step-level state outside the op window, where one fingerprint per group
        (all parameters, all gradients, ...) is enough. ``views``: the group's word views
        kept from the previous step (hostwords.StateViews).
        """
        if on_device:
            fast: list[np.ndarray | None] = [None] * len(tensors)
        elif views is not None:
            fast = views.words(list(tensors))
        else:
            fast = [dense_cpu_words(t) for t in tensors]
        # device -> (tensor, its zero-copy host words if it is a plain dense CPU tensor)
        groups: dict[Any, list[tuple[torch.Tensor, np.ndarray | None]]] = {}
        for tensor, words in zip(tensors, fast, strict=True):
            if words is not None:  # its own leaf: _leaves' checks are not needed
                if words.size:
                    groups.setdefault(_CPU, []).append((tensor, words))
                continue
            for t in _leaves(tensor) or ():
                if t.numel():
                    groups.setdefault(t.device, []).append((t, None))
        out: dict[str, Content] = {}
        for device, items in groups.items():
            # The host path reads zero-copy views; a non-contiguous CPU tensor would need a
            # whole copy there, so such a group takes the (chunked) torch path instead.
            if device.type == "cpu" and not on_device and all(
                    w is not None or t.is_contiguous() or t.layout == torch.sparse_coo
                    for t, w in items):
                out[str(device)] = host_content(
                    [host_words(t) if w is None else w for t, w in items])
            else:
                stage = self._stage(device)
                out[str(device)] = self._device_sum([_word_pieces(t, stage) for t, _ in items],
                                                    device)
        return out

    # -- device path ----------------------------------------------------------------------
    def _device_sum(self, parts: list[tuple[int, Iterator[torch.Tensor]]],
                    device: Any) -> torch.Tensor:
        """Products are written into a scratch buffer at their place in the concatenation,
        chunk by chunk: equal to the sum over the concatenated words of ``parts`` (each a
        word count and its pieces, see ``_word_pieces``) without allocating it. Narrow words
        are widened into the scratch buffer, one chunk at a time."""
        total = sum(n for n, _ in parts)
        if total == 0:
            return torch.zeros((), dtype=torch.int64, device=device)
        room = min(total, CHUNK_WORDS)
        keys, scratch = self._keys_for(device, room), self._scratch_for(device, room)
        partial: list[torch.Tensor] = []
        pos = 0
        for w in (piece for _, pieces in parts for piece in pieces):
            start, n = 0, w.numel()
            while start < n:
                take = min(n - start, CHUNK_WORDS - pos)
                out = scratch[pos : pos + take]
                if w.dtype == torch.int64:
                    torch.mul(w[start : start + take], keys[pos : pos + take], out=out)
                else:  # widen into the scratch itself: a mixed-dtype mul allocates a temporary
                    out.copy_(w[start : start + take]).mul_(keys[pos : pos + take])
                pos, start = pos + take, start + take
                if pos == CHUNK_WORDS:
                    partial.append(scratch.sum())
                    pos = 0
        if pos:
            partial.append(scratch[:pos].sum())
        if len(partial) == 1:
            return partial[0]
        weights = self._chunk_keys.get(device)
        if weights is None or weights.numel() < len(partial):
            cuda.retire(weights)  # another stream may still read it (Note [Streams])
            weights = _from_numpy(chunk_keys(max(len(partial), 4096))).to(device)
            self._chunk_keys[device] = weights
        return (torch.stack(partial) * weights[: len(partial)]).sum()

    def _keys_for(self, device: Any, n: int) -> torch.Tensor:
        keys = self._keys.get(device)
        if keys is None or keys.numel() < n:
            size = min(CHUNK_WORDS, max(n, 4096, 2 * (0 if keys is None else keys.numel())))
            if device.type == "cuda":
                # Full size at once: growing would allocate inside a CUDA graph capture
                # and free a buffer other streams may still read (cuda.py).
                size = CHUNK_WORDS
            cuda.retire(keys)
            keys = _from_numpy(position_keys(size)).to(device)
            self._keys[device] = keys
        return keys

    def _scratch_for(self, device: Any, n: int) -> torch.Tensor:
        # Per thread and, on CUDA, per stream: hashes on two streams must not share it.
        scratch: dict[Any, torch.Tensor] = self._local.__dict__.setdefault("s", {})
        key = cuda.stream_key(device)
        buf = scratch.get(key)
        if buf is None or buf.numel() < n:
            cuda.retire(buf)
            buf = torch.empty(min(CHUNK_WORDS, max(n, 4096)), dtype=torch.int64, device=device)
            scratch[key] = buf
        return buf

    def _stage(self, device: Any) -> Stage:
        """Staging byte buffers of this thread and device (and CUDA stream), made when first
        needed."""
        buffers: dict[Any, torch.Tensor] = self._local.__dict__.setdefault("b", {})
        key = cuda.stream_key(device)

        def get(i: int) -> torch.Tensor:
            buf = buffers.get((key, i))
            if buf is None:  # one block plus a carried word
                buf = buffers[(key, i)] = torch.empty(_BLOCK_BYTES + 8, dtype=torch.uint8,
                                                      device=device)
            return buf

        return get

    @staticmethod
    def words(tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor's bytes as a 1-D int64 tensor of words (see the Note), or None.
        A wrapper subclass's words are those of its inner tensors, concatenated."""
        leaves = _leaves(tensor)
        if leaves is None:
            return None
        if len(leaves) > 1:
            return torch.cat([TorchHasher.words(x) for x in leaves])  # type: ignore[misc]
        t = leaves[0]
        if t.layout == torch.sparse_coo:
            parts = [TorchHasher.words(t._indices()), TorchHasher.words(t._values())]
            return torch.cat(parts)  # type: ignore[arg-type]
        flat = t.reshape(-1)
        if flat.numel() and flat.stride(0) != 1:  # expanded or strided: copy to dense
            flat = flat.new_empty(flat.shape).copy_(flat)
        size = flat.element_size()
        word = word_size(flat.numel() * size)
        if (flat.storage_offset() * size) % word:  # wider words need an aligned start
            flat = flat.new_empty(flat.shape).copy_(flat)
        raw = flat.view(torch.uint8)  # every dtype has a byte view
        words = raw.view(_WORD_DTYPES[word]) if word > 1 else raw
        return words if word == 8 else words.to(torch.int64)

    @staticmethod
    def stats(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sum, max |x|) as float64 device scalars, for floating and complex tensors; None
        where they cannot be computed (they only size a difference, never decide one)."""
        return TorchHasher.stats_many([tensor])[0]

    @staticmethod
    def stats_many(tensors: Sequence[torch.Tensor]
                   ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """``stats`` of each tensor, the max |x| of all those of one device and dtype in one
        call (``torch._foreach_norm`` with ord=inf is max |x|, exactly: no arithmetic):
        a step with op capture has them for every parameter, gradient and Adam state."""
        ready = [_stat_input(t) for t in tensors]
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(ready)
        groups: dict[tuple[Any, Any], list[int]] = {}
        for i, t in enumerate(ready):
            if t is None:
                continue
            if t.numel() == 0:
                zero = torch.zeros((), dtype=torch.float64, device=t.device)
                out[i] = zero, zero
            else:
                groups.setdefault((t.device, t.dtype), []).append(i)
        for indices in groups.values():
            parts = [t for t in (ready[i] for i in indices) if t is not None]
            maxabs = torch.stack(torch._foreach_norm(parts, math.inf)).to(torch.float64)
            for i, t, m in zip(indices, parts, maxabs.unbind(), strict=True):
                out[i] = t.sum(dtype=torch.float64), m
        return out


def _stat_input(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real floating values ``stats`` reduces, or None where there are none."""
    t = _prepare(tensor)
    if (t is None or t.layout != torch.strided or t.is_nested
            or not (t.is_floating_point() or t.is_complex())):
        return None
    if t.is_complex():
        t = torch.view_as_real(t)  # _prepare resolved conj/neg views
    if t.dtype not in _REDUCIBLE:
        # fp8/fp4 have no reduction kernels: widen (exact: their values are float32
        # values). Step-level state only, in steps with op capture.
        try:
            t = t.to(torch.float32)
        except (RuntimeError, NotImplementedError):  # no conversion kernel (fp4 x2)
            return None
    return t


def _plain(t: torch.Tensor) -> bool:
    kind = type(t)
    return (kind in (torch.Tensor, torch.nn.Parameter)
            or kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


def _inner(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors a wrapper subclass holds its data in: its ``__tensor_flatten__``
    attributes (a DTensor's local shard, what ``to_local()`` returns a view of; float8 data
    and scale; NF4 blocks), or None (FakeTensor, FunctionalTensor and other compile
    internals hold no data of the run). Attribute reads only: no op runs."""
    kind = type(t)
    if kind.__module__.startswith("torch._subclasses"):
        return None
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    names, _ = flatten()
    # DTensor also lists its device mesh: only tensors hold data.
    inner = [x for x in (getattr(t, name, None) for name in names) if isinstance(x, torch.Tensor)]
    return inner or None


def _leaves(tensor: torch.Tensor, depth: int = 0) -> list[torch.Tensor] | None:
    """Plain tensors whose bytes are ``tensor``'s content: itself, prepared, or the inner
    tensors of a wrapper subclass (in ``__tensor_flatten__`` order), or None."""
    t = tensor.detach()
    if _plain(t):
        p = _prepare(t)
        return None if p is None else [p]
    inner = _inner(t) if depth < 4 else None
    if not inner:
        return None
    out: list[torch.Tensor] = []
    for x in inner:
        leaves = _leaves(x, depth + 1)
        if leaves is None:
            return None
        out.extend(leaves)
    return out


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor to copy to the host for ``tensor``: a DTensor's local shard, or the
    inner tensor of another wrapper that has the wrapper's shape (float8 data); the tensor
    itself otherwise."""
    t = tensor.detach()
    if _plain(t):
        return t
    inner = _inner(t) or []
    if type(t).__name__ == "DTensor" and inner:
        return local_tensor(inner[0])
    same_shape = [x for x in inner if x.shape == t.shape]
    return local_tensor(same_shape[0]) if same_shape else t


def storage_owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s data: ``t``, or a wrapper subclass's first
    inner tensor. A wrapper's own storage is an empty placeholder made per object, so
    tracking it would tell apart wrappers of the same data (and reuse addresses)."""
    for _ in range(4):
        if _plain(t):
            return t
        inner = _inner(t)
        if not inner:
            return t
        t = inner[0]
    return t


def _prepare(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor as plain values (sparse coalesced, quantized as integers, conj/neg
    resolved), or None if it has no local data we can trust."""
    t = tensor.detach()
    # Subclasses that override dispatch are unwrapped by _leaves first: their own bytes
    # are not the data.
    if not _plain(t):
        return None
    if t.device.type == "meta":
        return None
    if t.layout == torch.sparse_coo:
        return t.coalesce()
    if t.layout != torch.strided:
        return None
    if t.is_quantized:
        t = t.int_repr()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


Stage = Callable[[int], torch.Tensor]  # staging byte buffer number i (0 or 1)
_BLOCK_BYTES = CHUNK_WORDS * 8


def _word_pieces(t: torch.Tensor, stage: Stage) -> tuple[int, Iterator[torch.Tensor]]:
    """The words of a prepared tensor (as ``TorchHasher.words``) as a count and a stream of
    1-D pieces of at most CHUNK_WORDS words each, NOT widened to int64 (``_device_sum``
    widens each piece into its scratch: uint8 words zero-extended, int32 sign-extended, as
    ``.to(torch.int64)`` would). Pieces of a contiguous, aligned tensor are views; anything
    else is copied block by block into two fixed staging buffers (``stage``), so the extra
    memory is bounded whatever the tensor's size, layout or alignment, and nothing is
    allocated per chunk. A piece is valid until the next one is taken."""
    if t.layout == torch.sparse_coo:
        parts = [_word_pieces(t._indices(), stage), _word_pieces(t._values(), stage)]
        return sum(n for n, _ in parts), (p for _, pieces in parts for p in pieces)
    nbytes = t.numel() * t.element_size()
    word = word_size(nbytes)
    return nbytes // word, _regroup(_byte_blocks(t, stage), word, stage)


def _byte_blocks(t: torch.Tensor, stage: Stage) -> Iterator[torch.Tensor]:
    """``t``'s bytes in row-major order as 1-D uint8 tensors of at most _BLOCK_BYTES:
    views of a contiguous tensor; else each block copied into staging buffer 0."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        raw = t.reshape(-1).view(torch.uint8)  # every dtype has a byte view
        for start in range(0, raw.numel(), _BLOCK_BYTES):
            yield raw[start : start + _BLOCK_BYTES]
        return
    size = t.element_size()
    for block in _dense_blocks(t, _BLOCK_BYTES // size):
        raw = stage(0)[: block.numel() * size]
        raw.view(t.dtype).view(block.shape).copy_(block)
        yield raw


def _dense_blocks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Consecutive row-major blocks (views) of ``t``, at most ``limit`` elements each."""
    if t.numel() <= limit:
        yield t
    elif t.dim() == 1:
        for start in range(0, t.shape[0], limit):
            yield t[start : start + limit]
    elif t[0].numel() <= limit:
        rows = limit // t[0].numel()
        for start in range(0, t.shape[0], rows):
            yield t[start : start + rows]
    else:
        for i in range(t.shape[0]):
            yield from _dense_blocks(t[i], limit)


def _regroup(blocks: Iterator[torch.Tensor], word: int, stage: Stage) -> Iterator[torch.Tensor]:
    """Byte blocks as word pieces of at most CHUNK_WORDS words. A word split between two
    blocks is carried over (a few bytes); a misaligned start is copied to staging buffer 1."""
    dtype = _WORD_DTYPES[word]
    carry: torch.Tensor | None = None
    for block in blocks:
        if carry is not None or block.storage_offset() % word:  # wider words need alignment
            head = 0 if carry is None else carry.numel()
            staged = stage(1)[: head + block.numel()]
            if carry is not None:
                staged[:head].copy_(carry)
            staged[head:].copy_(block)
            block, carry = staged, None
        usable = block.numel() - block.numel() % word
        if usable < block.numel():
            carry = block[usable:].clone()  # under one word
            block = block[:usable]
        if not usable:
            continue
        words = block.view(dtype) if word > 1 else block
        for start in range(0, words.numel(), CHUNK_WORDS):
            yield words[start : start + CHUNK_WORDS]
