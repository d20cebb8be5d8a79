"""Collectives (torch.distributed) as the recorder sees them: phase ``comm``, outputs read
only once the work is done.

A collective dispatched through c10d's ops (``c10d.allreduce_``, ``c10d.broadcast_``, ...;
DDP's bucket all-reduce too) returns before its work completes: gloo and NCCL fill the
outputs from their own threads or streams until ``Work.wait``. Hashing them at dispatch
would read buffers still being written, a difference nondet itself would create. So a
collective's record holds its inputs' fingerprints (taken before the call) and no output
fingerprint; its output tensors are forgotten by the fingerprint cache, and their first
reader, which runs after the wait (DDP waits before the optimizer step, user code after
``work.wait()``), fingerprints them afresh as an entry point named after the collective
(``comm:c10d.recv_.default``). ``nondet.jobs`` turns such an entry into a ``collective``
finding when every rank's inputs to the collectives up to it matched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: Name of the entry a collective's output makes at its first reader: "comm:<op>".
ENTRY_PREFIX = "comm:"

#: Dispatcher namespaces of torch.distributed's collectives and point-to-point ops.
COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


def is_comm(func: Any) -> bool:
    """Is this op overload a collective or point-to-point op of torch.distributed?"""
    namespace = getattr(func, "namespace", None)
    if namespace is None:
        namespace = str(func).split(".", 1)[0]
    return namespace in COMM_NAMESPACES


def tensors_deep(value: Any) -> Iterator[Any]:
    """Every tensor in an op's arguments or result, through nested lists and tuples
    (``Tensor[][]``): the schema's one level is not enough for collectives."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_deep(item)
