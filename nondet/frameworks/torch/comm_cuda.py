"""The NCCL (CUDA) half of reading a collective's output: the hash must run after the
collective's stream work, without a host synchronization. Not run on this project's
machines (no GPU): unit-tested with CUDA faked (tests/frameworks/test_torch_comm.py).

NCCL runs a collective on its own stream and ``Work.wait()`` makes the *current* stream
wait for the work's end event (``cudaStreamWaitEvent``; the host blocks only under
``TORCH_NCCL_BLOCKING_WAIT``). nondet's hash kernels run on the current stream (Note
[Streams] in cuda.py), so after such a wait they are queued behind the collective:

- after the script's own ``wait()`` that ordering is already in place (same thread, same
  current stream);
- for DDP's buckets, waited by the reducer inside the backward engine, on whatever stream
  it had current there: ``order_after`` asks the work again for the current stream. Waiting
  on a work that has completed is a no-op on the device; it never blocks the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def on_device(tensors: Sequence[Any]) -> bool:
    """Any tensor of the call lives on a CUDA device (without touching CUDA itself)."""
    return any(getattr(t, "is_cuda", False) for t in tensors)


def order_after(work: Any | None, tensors: Sequence[Any]) -> bool:
    """Order the current stream after ``work`` when its tensors are on CUDA; True if it
    did (the hash then runs on the device after the collective), False on CPU, where the
    wait that made the caller read already means the bytes are final."""
    if not on_device(tensors):
        return False
    if work is not None:
        work.wait()  # NCCL: a stream-on-event wait, queued; no host sync (module docstring)
    return True
