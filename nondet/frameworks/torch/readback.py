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

from collections.abc import Sequence

import numpy as np
import torch

from nondet.frameworks.torch import cuda

#: Host read-backs made so far (one per device per ``read_back`` call); tests bound it.
READBACKS = 0


def read_back(ints: Sequence[torch.Tensor],
              floats: Sequence[torch.Tensor] = ()) -> tuple[list[int], list[float]]:
    """The values of 0-dim int64 tensors ``ints`` and float64 tensors ``floats``, in order,
    with one device-to-host transfer per device."""
    global READBACKS
    tensors = [t.reshape(()) for t in ints] + [t.reshape(()).view(torch.int64) for t in floats]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    cuda.synchronize(by_device)
    words = [0] * len(tensors)
    for positions in by_device.values():
        group = [tensors[i] for i in positions]
        cuda.hand_over(group)
        values = torch.stack(group).tolist()
        READBACKS += 1
        for i, value in zip(positions, values, strict=True):
            words[i] = value
    n = len(ints)
    as_floats = np.array(words[n:], dtype=np.int64).view(np.float64).tolist()
    return words[:n], as_floats
