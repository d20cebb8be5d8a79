"""Collectives (torch.distributed) as the recorder sees them: phase ``comm``, inputs hashed
before the call, outputs hashed once the work is done, never before.

A collective dispatched through c10d's ops (``c10d.allreduce_``, ``c10d.broadcast_``, ...;
DDP's bucket all-reduce too) returns before its work completes: gloo and NCCL fill the
outputs from their own threads or streams until ``Work.wait``. Hashing them at dispatch
would read buffers still being written, a difference nondet itself would create. So:

- At dispatch the record gets its inputs' fingerprints, and every tensor of the call is
  forgotten by the fingerprint cache: its first reader fingerprints it afresh, as an entry
  named after the collective (``comm:c10d.recv_.default``).
- ``Collectives`` keeps the call (Note [When a collective's output is read]) and, once the
  work is known to be done, adds the fingerprint of its tensors to the collective's own
  record, with what the op record cannot hold (backend, group size, DDP bucket) in a row
  of the capture's ``comm`` table (``records.COMM_DTYPE``).

Note [When a collective's output is read]
Only at points the script itself fixes, so that both runs read (or skip) the same records:
right after the script's ``Work.wait()`` returns (``dist.all_reduce`` without
``async_op`` waits too), and for DDP's gradient buckets at the end of the backward pass
(DDP waits for every bucket there; its reducer waits in C++, where no Python hook sees
it). Polling ``Work.is_completed()`` would be cheaper to hook but is timing: one run would
find the work done at its step end and the other not, and "hashed" against "not hashed" is
a difference nondet would have made. A collective the script did not wait for within its
step (``work.get_future()``, a wait in a later step) keeps no output fingerprint
(``CommOutput.NOT_READ``), in both runs alike. A DDP bucket is an ``allreduce_``
dispatched during backward while a ``DistributedDataParallel`` module is the model; its
index counts the buckets of that backward (the reducer launches them in index order).
On CUDA (NCCL) the hash is queued on the current stream after the work's event
(``comm_cuda.order_after``): no host synchronization.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nondet.frameworks.fp import Fp
from nondet.frameworks.torch import comm_cuda
from nondet.records import COMM_DTYPE, CommOutput

#: Name of the entry a collective's output makes at its first reader: "comm:<op>".
ENTRY_PREFIX = "comm:"

#: Dispatcher namespaces of torch.distributed's collectives and point-to-point ops.
COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})

#: The op DDP's reducer all-reduces a gradient bucket with.
_BUCKET_OP = "c10d.allreduce_"

#: Ops that fill their output buffers completely, so a buffer that was uninitialized memory
#: before (``torch.empty``) holds data once they are done. Any other op's uninitialized
#: tensors (the one ``barrier`` passes, a ``reduce_`` result on a rank that is not its
#: destination) may still hold whatever the allocator left there: never hashed.
_FILLS_OUTPUTS = frozenset({
    "recv_", "recv_any_source_", "broadcast_", "allgather_", "_allgather_base_",
    "allgather_into_tensor_coalesced_", "allgather_coalesced_", "reduce_scatter_",
    "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_",
    "alltoall_base_", "scatter_", "gather_"})


def is_wait(name: str) -> bool:
    """``_c10d_functional.wait_tensor``: returns once a functional collective's result is
    done. Its input is still being written when it is dispatched: never hashed then; its
    output, read right after, is the collective's result."""
    return name.split(".", 2)[1:2] == ["wait_tensor"]


def fills_outputs(name: str) -> bool:
    """``c10d.recv_.default`` -> whether it fills its buffers (``_FILLS_OUTPUTS``)."""
    parts = name.split(".")
    return len(parts) > 1 and parts[1] in _FILLS_OUTPUTS


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


def group_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int]:
    """(backend name, group size) of the process group a c10d op names; ("", -1) when
    none can be read. c10d's ops carry the group as a TorchScript object."""
    import torch

    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return "", -1
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.ScriptObject):
            try:
                group = c10d.ProcessGroup.unbox(value)
            except Exception:  # a ReduceOp, a Work: not the group
                continue
            return str(group.name()), int(group.size())
    return "", -1


def is_ddp(roots: Iterable[Any]) -> bool:
    """Is one of the script's root modules a DistributedDataParallel?"""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    return ddp is not None and any(isinstance(root, ddp.DistributedDataParallel)
                                   for root in roots)


def work_of(out: Any) -> Any | None:
    """The ``Work`` a c10d op returns (the same object the script's ``wait`` is called on);
    None for ops without one (functional collectives)."""
    import torch

    c10d = sys.modules.get("torch._C._distributed_c10d")
    last = out[-1] if isinstance(out, tuple) and out else out  # send_/recv_: the Work alone
    if c10d is None or not isinstance(last, torch.ScriptObject):
        return None
    try:
        return c10d.Work.unbox(last)
    except Exception:
        return None


@dataclass
class Launched:
    """One collective of the current step, until its output is read (or given up)."""

    outs: list[Fp]  # the op record's output fingerprints (the same list object)
    tensors: list[weakref.ref[Any]]
    work: Any | None
    backend: str
    group_size: int
    nbytes: int
    bucket: int = -1
    output: CommOutput = CommOutput.NOT_READ
    settled: bool = field(default=False)


class Collectives:
    """The collectives of the current step (module docstring). ``fingerprint`` hashes one
    tensor (queued on its device, read at the step end); ``paused`` runs nondet's own torch
    work unrecorded; ``is_ddp_model`` says whether a DistributedDataParallel is training."""

    def __init__(self, fingerprint: Callable[[Any], Fp],
                 paused: Callable[[], AbstractContextManager[None]],
                 is_ddp_model: Callable[[], bool]) -> None:
        self.fingerprint = fingerprint
        self.paused = paused
        self.is_ddp_model = is_ddp_model
        self.launched: list[Launched] = []
        self._waiting: dict[int, list[Launched]] = {}  # id(work) -> its calls (work kept)
        self._next_bucket = 0

    def is_bucket(self, name: str, in_backward: bool) -> bool:
        """Is this collective DDP's all-reduce of a gradient bucket? (Note [When a
        collective's output is read])"""
        return in_backward and name.startswith(_BUCKET_OP) and self.is_ddp_model()

    def launch(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
               outs: list[Fp], bucket: bool, unset: AbstractSet[int] = frozenset()) -> None:
        """A collective was dispatched (its record holds ``outs``); ``bucket``: DDP's
        (``is_bucket``); ``unset``: ids of its tensors that were uninitialized memory."""
        fills = fills_outputs(name)
        tensors: list[Any] = []
        for t in tensors_deep((args, tuple(kwargs.values()), out)):
            if not any(t is seen for seen in tensors) and (fills or id(t) not in unset):
                tensors.append(t)
        backend, size = group_of(args, kwargs)
        call = Launched(outs=outs, tensors=[weakref.ref(t) for t in tensors],
                        work=work_of(out), backend=backend, group_size=size,
                        nbytes=sum(_nbytes(t) for t in tensors))
        if bucket:
            call.bucket = self._next_bucket
            self._next_bucket += 1
        self.launched.append(call)
        if is_wait(name):  # the wait is done: this is a point the script fixed
            self._read(call, CommOutput.AFTER_WAIT)
        elif call.work is not None:
            self._waiting.setdefault(id(call.work), []).append(call)

    def waited(self, work: Any) -> None:
        """The script's ``Work.wait()`` returned: that work's outputs are final."""
        calls = self._waiting.pop(id(work), None)
        if not calls:
            return
        for call in calls:
            if call.work is work:
                self._read(call, CommOutput.AFTER_WAIT)

    def backward_done(self) -> None:
        """The backward pass ended: DDP has waited for every bucket it launched."""
        for call in self.launched:
            if call.bucket >= 0 and not call.settled:
                self._read(call, CommOutput.AFTER_BACKWARD)
        self._next_bucket = 0

    def _read(self, call: Launched, how: CommOutput) -> None:
        call.settled = True
        work, call.work = call.work, None  # a Work holds its tensors: let them go
        if work is not None:
            self._waiting.pop(id(work), None)  # before order_after's own wait() comes back
        tensors = [t for t in (ref() for ref in call.tensors) if t is not None]
        if len(tensors) != len(call.tensors):
            return  # a tensor of the call is gone (in both runs alike): nothing to read
        with self.paused():
            if comm_cuda.order_after(work, tensors):  # NCCL: after its stream work
                how = CommOutput.ON_DEVICE
            call.outs.extend(self.fingerprint(t) for t in tensors)
        call.output = how

    def take_rows(self, step: int, records: list[tuple[Any, ...]],
                  intern: Callable[[str], int]) -> np.ndarray:
        """COMM_DTYPE rows of the step's collectives (``records``: the recorder's records,
        whose output lists identify them); forgets every call, read or not."""
        where = {id(record[6]): i for i, record in enumerate(records)}
        rows = [(step, where[id(c.outs)], intern(c.backend) if c.backend else -1,
                 c.group_size, c.bucket, c.nbytes, int(c.output))
                for c in self.launched if id(c.outs) in where]
        self.launched, self._waiting, self._next_bucket = [], {}, 0
        return np.array(rows, dtype=COMM_DTYPE) if rows else np.zeros(0, dtype=COMM_DTYPE)


def _nbytes(t: Any) -> int:
    try:
        return int(t.numel()) * int(t.element_size())
    except Exception:
        return -1


#: Who hears of a returned ``Work.wait()`` (the backend of this process; ``install``).
_listener: list[Callable[[Any], None]] = []


def install(on_wait: Callable[[Any], None]) -> None:
    """Observe ``Work.wait()``: ``on_wait(work)`` runs after a wait has returned normally
    (its own errors are the caller's to contain: the backend's guard). The class is patched
    once per process; a later call (a child process's own backend) replaces the listener."""
    _listener[:] = [on_wait]
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        try:
            import torch.distributed as dist

            if not dist.is_available():
                return
            c10d = sys.modules["torch._C._distributed_c10d"]
        except Exception:
            return
    work_class = c10d.Work
    original = work_class.wait
    if getattr(original, "__nondet_wrapped__", False):
        return

    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for listener in _listener:
            listener(self)
        return result

    wait.__nondet_wrapped__ = True  # type: ignore[attr-defined]
    work_class.wait = wait
