"""Tensor fingerprints computed with torch ops on the tensor's own device.

See Note [Fingerprint definition] in nondet/fingerprint.py. Only the 0-dim int64 sum is
computed here (on the device, asynchronously); callers collect many of them and copy them
to the host in one go at the end of a step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from nondet.fingerprint import CHUNK_WORDS, chunk_keys, position_keys

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 1: torch.uint8}
# Taken before nondet wraps torch.from_numpy to see data entering the user's script.
_from_numpy = torch.from_numpy


class TorchHasher:
    """Computes content sums; keeps per-device keys and per-thread scratch buffers."""

    def __init__(self) -> None:
        self._keys: dict[torch.device, torch.Tensor] = {}
        self._chunk_keys: dict[torch.device, torch.Tensor] = {}
        self._local = threading.local()  # scratch per thread: autograd may run on other threads

    def _keys_for(self, device: torch.device, n: int) -> torch.Tensor:
        keys = self._keys.get(device)
        if keys is None or keys.numel() < n:
            size = min(CHUNK_WORDS, max(n, 4096, 2 * (0 if keys is None else keys.numel())))
            keys = _from_numpy(position_keys(size)).to(device)
            self._keys[device] = keys
        return keys

    def _scratch_for(self, device: torch.device, n: int) -> torch.Tensor:
        scratch: dict[torch.device, torch.Tensor] = self._local.__dict__.setdefault("s", {})
        buf = scratch.get(device)
        if buf is None or buf.numel() < n:
            buf = torch.empty(min(CHUNK_WORDS, max(n, 4096)), dtype=torch.int64, device=device)
            scratch[device] = buf
        return buf

    def content(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """0-dim int64 tensor with the content sum, or None if the tensor has no readable data."""
        words = self.words(tensor)
        if words is None:
            return None
        n = words.numel()
        if n == 0:
            return torch.zeros((), dtype=torch.int64, device=words.device)
        device = words.device
        if n <= CHUNK_WORDS:
            keys = self._keys_for(device, n)
            scratch = self._scratch_for(device, n)
            return torch.mul(words, keys[:n], out=scratch[:n]).sum()
        keys = self._keys_for(device, CHUNK_WORDS)
        scratch = self._scratch_for(device, CHUNK_WORDS)
        partial = []
        for start in range(0, n, CHUNK_WORDS):
            part = words[start : start + CHUNK_WORDS]
            m = part.numel()
            partial.append(torch.mul(part, keys[:m], out=scratch[:m]).sum())
        weights = self._chunk_keys.get(device)
        if weights is None or weights.numel() < len(partial):
            weights = _from_numpy(chunk_keys(max(len(partial), 64))).to(device)
            self._chunk_keys[device] = weights
        return (torch.stack(partial) * weights[: len(partial)]).sum()

    @staticmethod
    def words(tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor's bytes as a 1-D int64 tensor of words (see the Note), or None."""
        t = tensor.detach()
        if not _plain_enough(t):
            return None
        if t.layout == torch.sparse_coo:
            t = t.coalesce()
            parts = [TorchHasher.words(t._indices()), TorchHasher.words(t._values())]
            if any(p is None for p in parts):
                return None
            return torch.cat(parts)  # type: ignore[arg-type]
        if t.layout != torch.strided:
            return None
        if t.is_quantized:
            t = t.int_repr()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        flat = t.reshape(-1)
        if flat.numel() and flat.stride(0) != 1:  # expanded or strided: copy to dense
            flat = flat.new_empty(flat.shape).copy_(flat)
        size = flat.element_size()
        nbytes = flat.numel() * size
        word = 8 if nbytes % 8 == 0 else 4 if nbytes % 4 == 0 else 1
        if (flat.storage_offset() * size) % word:  # wider words need an aligned start
            flat = flat.new_empty(flat.shape).copy_(flat)
        raw = flat.view(torch.uint8)  # every dtype has a byte view
        words = raw.view(_WORD_DTYPES[word]) if word > 1 else raw
        return words if word == 8 else words.to(torch.int64)

    @staticmethod
    def stats(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sum, max |x|) as float64 device scalars, for floating and complex tensors."""
        t = tensor.detach()
        if t.layout != torch.strided or not (t.is_floating_point() or t.is_complex()):
            return None
        if t.numel() == 0:
            zero = torch.zeros((), dtype=torch.float64, device=t.device)
            return zero, zero
        if t.is_complex():
            t = torch.view_as_real(t.resolve_conj())
        return t.sum(dtype=torch.float64), t.abs().max().to(torch.float64)


def _plain_enough(t: Any) -> bool:
    # Tensor subclasses that override dispatch (FakeTensor, DTensor, functional wrappers) have
    # no local bytes we can trust to be the data; nn.Parameter and plain tensors do.
    if t.device.type == "meta":
        return False
    return type(t) in (torch.Tensor, torch.nn.Parameter) or (
        type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    )
