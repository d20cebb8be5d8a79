"""The content sum computed by torch ops on a tensor's own device (Note [Fingerprint
definition]): products of words and position keys written into a scratch buffer chunk by
chunk and summed, so the extra memory is a few chunks whatever the tensor's size, layout or
alignment. The result stays a 0-dim int64 tensor on the device until the step end. Used on
accelerators, and on the CPU for large tensors that are not contiguous (hashing.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nondet.fingerprint import CHUNK_WORDS, chunk_keys, position_keys, word_size
from nondet.frameworks.torch import cuda

WORD_DTYPES = {8: torch.int64, 4: torch.int32, 1: torch.uint8}
# Taken before nondet wraps torch.from_numpy to see data entering the user's script.
_from_numpy = torch.from_numpy


class DeviceSums:
    """Per-device keys and per-thread (and per-stream) scratch and staging buffers."""

    def __init__(self) -> None:
        self._keys: dict[torch.device, torch.Tensor] = {}
        self._chunk_keys: dict[torch.device, torch.Tensor] = {}
        self._local = threading.local()  # scratch per thread: autograd may run on other threads

    def sum(self, parts: list[tuple[int, Iterator[torch.Tensor]]],
                    device: Any) -> torch.Tensor:
        """Products are written into a scratch buffer at their place in the concatenation,
        chunk by chunk: equal to the sum over the concatenated words of ``parts`` (each a
        word count and its pieces, see ``word_pieces``) without allocating it. Narrow words
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

    def stage(self, device: Any) -> Stage:
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


Stage = Callable[[int], torch.Tensor]  # staging byte buffer number i (0 or 1)
_BLOCK_BYTES = CHUNK_WORDS * 8


def word_pieces(t: torch.Tensor, stage: Stage) -> tuple[int, Iterator[torch.Tensor]]:
    """The words of a prepared tensor (as ``TorchHasher.words``) as a count and a stream of
    1-D pieces of at most CHUNK_WORDS words each, NOT widened to int64 (``DeviceSums.sum``
    widens each piece into its scratch: uint8 words zero-extended, int32 sign-extended, as
    ``.to(torch.int64)`` would). Pieces of a contiguous, aligned tensor are views; anything
    else is copied block by block into two fixed staging buffers (``stage``), so the extra
    memory is bounded whatever the tensor's size, layout or alignment, and nothing is
    allocated per chunk. A piece is valid until the next one is taken."""
    if t.layout == torch.sparse_coo:
        parts = [word_pieces(t._indices(), stage), word_pieces(t._values(), stage)]
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
    dtype = WORD_DTYPES[word]
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
