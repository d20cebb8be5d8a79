"""Reading device values back to the host: once per device per step, never per tensor.

A read-back (``.item()``, ``float(t)``, ``.tolist()``) waits until the device has finished
everything queued before it: one per tensor on the hot path would serialize the user's
GPU job on nondet. Fingerprint sums (int64) and statistics (float64: parameter sums, the
loss, per-tensor sum and max |x|) are therefore kept as 0-dim device tensors until the step
ends, and ``read_back`` moves all of them in one transfer per device: floats travel as
their int64 bit patterns, stacked with the sums. Before it, every stream of each CUDA
device is waited for once (Note [Streams] in cuda.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from nondet.frameworks.torch import cuda
from nondet.frameworks.torch.tensors import item, tolist

#: Host read-backs made so far (one per device per ``read_back`` call); tests bound it.
READBACKS = 0


def read_back(ints: Sequence[torch.Tensor],
              floats: Sequence[torch.Tensor] = ()) -> tuple[list[int], list[float]]:
    """The values of 0-dim int64 tensors ``ints`` and float64 tensors ``floats``, in order,
    with one device-to-host transfer per device (a sync the script's sync debug mode does
    not count: ``cuda.own_syncs``)."""
    with cuda.own_syncs():
        return _read_back(ints, floats)


def _read_back(ints: Sequence[torch.Tensor],
               floats: Sequence[torch.Tensor]) -> tuple[list[int], list[float]]:
    global READBACKS
    values: list[int | float] = [0] * (len(ints) + len(floats))
    plain: list[tuple[int, torch.Tensor]] = []
    for i, t in enumerate((*ints, *floats)):
        if t.device.type == "meta":
            # no values to read (a model trained on the meta device, shapes only): the
            # loss and parameter sum of such a step are NaN, as for a model with none
            values[i] = 0 if i < len(ints) else math.nan
            continue
        if type(t) is torch.Tensor:
            t = t.reshape(())
            plain.append((i, t if i < len(ints) else t.view(torch.int64)))
        else:
            # A wrapper subclass (a DTensor's loss or parameter sum): its own ``item`` may
            # have to combine shards, so it is read on its own.
            values[i] = item(t)
            READBACKS += 1
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in plain:
        by_device.setdefault(t.device, []).append((i, t))
    cuda.synchronize(by_device)
    for group in by_device.values():
        tensors = [t for _, t in group]
        cuda.hand_over(tensors)
        words = tolist(torch.stack(tensors))
        READBACKS += 1
        for (i, _), word in zip(group, words, strict=True):
            # floats travelled as their bit patterns
            values[i] = word if i < len(ints) else float(np.int64(word).view(np.float64))
    n = len(ints)
    return [int(v) for v in values[:n]], [float(v) for v in values[n:]]
