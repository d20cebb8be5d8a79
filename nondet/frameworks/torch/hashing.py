"""Tensor fingerprints: the content sum of Note [Fingerprint definition] for torch tensors.

Two implementations of the same number:

- on accelerators, torch ops on the tensor's own device (devicesum.py): the result stays
  a 0-dim int64 tensor until the end of the step, when all of them are copied to the host
  in one transfer;
- on the CPU, for small tensors and for groups of step-level state, a zero-copy NumPy view
  and ``np.dot`` (hostwords.py): exact integer arithmetic that wraps modulo 2**64 like the
  device path, without the overhead of several small torch calls or waking torch's OpenMP
  pool. It returns a Python int.

Tests force both paths on the same tensors and check that they agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nondet.fingerprint import host_content, word_size
from nondet.frameworks.torch import hoststats
from nondet.frameworks.torch.devicesum import WORD_DTYPES, DeviceSums, word_pieces
from nondet.frameworks.torch.hostwords import (
    StateViews,
    dense_cpu_content,
    dense_cpu_words,
    host_words,
    zero_copy,
)
from nondet.frameworks.torch.leaves import data_leaves, prepared

#: Floating dtypes with sum/abs/max kernels on every device; others are widened for stats.
_REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

Content = torch.Tensor | int
#: A statistic: a float64 device scalar (read back at the step end) or, computed on the
#: host (hoststats.py), already a float.
Stat = torch.Tensor | float
#: Non-contiguous CPU tensors above this many elements take the torch path (its staging
#: bounds the memory a copy would take); contiguous ones of any size are read zero-copy by
#: ``np.dot``, which writes no products: measured on the narrow benchmark model, it hashes
#: a freshly written 4 MB activation in about half the time of torch's multiply-then-sum
#: (single-threaded) and does not stall when other processes hold the cores.
HOST_LIMIT = 1 << 16
#: Non-contiguous CPU tensors up to this many elements are copied to host memory and read
#: there (at most 16 MiB, for complex128): no more than the torch path's own staging
#: (CHUNK_WORDS int64 words plus the product), and about 0.6x its time: a transposed
#: 1 MB linear weight, which a captured step of the narrow benchmark model reads once
#: (the backward's view of it, see docs/benchmarks.md "Sixth round"), 219 against 342 us.
HOST_COPY_LIMIT = 1 << 20
_CPU = torch.device("cpu")


class TorchHasher:
    """Computes content sums (the device path's keys and buffers are ``self.device``) and
    the float statistics of step-level state."""

    def __init__(self) -> None:
        self.device = DeviceSums()

    def content(self, tensor: torch.Tensor, *, on_device: bool = False) -> Content | None:
        """The content sum of ``tensor``, or None if it has no readable data.

        ``on_device=True`` forces the torch-op path on CPU tensors too (for tests).
        """
        if not on_device:
            value = dense_cpu_content(tensor)
            if value is not None:  # the common case, without the general machinery below
                return value
        leaves = data_leaves(tensor)
        if leaves is None:
            return None
        device = leaves[0].device
        if any(t.device != device for t in leaves):
            return None  # a wrapper with parts on several devices: no single sum
        if device.type == "cpu" and not on_device and (
                all(zero_copy(t) for t in leaves)
                or sum(t.numel() for t in leaves) <= HOST_COPY_LIMIT):
            return host_content([host_words(t) for t in leaves])
        return self.device.sum([word_pieces(t, self.device.stage(device)) for t in leaves], device)

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
            if words is not None:  # its own leaf: data_leaves' checks are not needed
                if words.size:
                    groups.setdefault(_CPU, []).append((tensor, words))
                continue
            for t in data_leaves(tensor) or ():
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
                stage = self.device.stage(device)
                out[str(device)] = self.device.sum([word_pieces(t, stage) for t, _ in items],
                                                    device)
        return out

    @staticmethod
    def words(tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor's bytes as a 1-D int64 tensor of words (see the Note), or None.
        A wrapper subclass's words are those of its inner tensors, concatenated."""
        leaves = data_leaves(tensor)
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
        words = raw.view(WORD_DTYPES[word]) if word > 1 else raw
        return words if word == 8 else words.to(torch.int64)

    @staticmethod
    def stats(tensor: torch.Tensor) -> tuple[Stat, Stat] | None:
        """(sum, max |x|) as floats (plain CPU tensors) or float64 device scalars, for
        floating and complex tensors; None where they cannot be computed (they only size a
        difference, never decide one)."""
        return TorchHasher.stats_many([tensor])[0]

    @staticmethod
    def stats_many(tensors: Sequence[torch.Tensor]) -> list[tuple[Stat, Stat] | None]:
        """``stats`` of each tensor: on the host for plain dense CPU tensors
        (hoststats.py), else with torch, the max |x| of all those of one device and dtype
        in one call (``torch._foreach_norm`` with ord=inf is max |x|, exactly: no
        arithmetic): a step with op capture has them for every parameter, gradient and
        Adam state."""
        out: list[tuple[Stat, Stat] | None] = [None] * len(tensors)
        groups: dict[tuple[Any, Any], list[tuple[int, torch.Tensor]]] = {}
        host: list[tuple[int, np.ndarray]] = []
        for i, tensor in enumerate(tensors):
            reals = hoststats.host_reals(tensor)
            if reals is not None:
                host.append((i, reals))
                continue
            t = _stat_input(tensor)
            if t is None:
                continue
            if t.numel() == 0:
                zero = torch.zeros((), dtype=torch.float64, device=t.device)
                out[i] = zero, zero
            else:
                groups.setdefault((t.device, t.dtype), []).append((i, t))
        for (i, _), pair in zip(host, hoststats.stats_many([r for _, r in host]), strict=True):
            out[i] = pair
        for members in groups.values():
            parts = [t for _, t in members]
            maxabs = torch.stack(torch._foreach_norm(parts, math.inf)).to(torch.float64)
            for (i, t), m in zip(members, maxabs.unbind(), strict=True):
                out[i] = t.sum(dtype=torch.float64), m
        return out


def _stat_input(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real floating values ``stats`` reduces, or None where there are none."""
    t = prepared(tensor)
    if (t is None or t.layout != torch.strided or t.is_nested
            or not (t.is_floating_point() or t.is_complex())):
        return None
    if t.is_complex():
        t = torch.view_as_real(t)  # prepared() resolved conj/neg views
    if t.dtype not in _REDUCIBLE:
        # fp8/fp4 have no reduction kernels: widen (exact: their values are float32
        # values). Step-level state only, in steps with op capture.
        try:
            t = t.to(torch.float32)
        except (RuntimeError, NotImplementedError):  # no conversion kernel (fp4 x2)
            return None
    return t
