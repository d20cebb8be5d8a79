"""Collectives as the torch recorder sees them (frameworks/torch/comm.py): phase comm,
inputs hashed before the call, outputs read only once the work is done (after the script's
``Work.wait()``, DDP's buckets after the backward), with backend, group size and bucket."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("torch")

import torch
import torch.distributed as dist

from nondet.frameworks.torch import comm, comm_cuda
from nondet.frameworks.torch.ops import OpRecorder
from nondet.records import CommOutput, Kind, Phase
from tests.frameworks.test_torch_capture import names, recording


@pytest.fixture()
def waits_seen() -> Iterator[list[OpRecorder]]:
    """``Work.wait()`` observed as the backend observes it, for the recorder appended."""
    recorders: list[OpRecorder] = []

    def waited(work: object) -> None:
        for recorder in recorders:
            recorder.collectives.waited(work)

    comm.install(waited)
    yield recorders
    comm.install(lambda work: None)


def _comm_rows(rec: OpRecorder) -> tuple[np.ndarray, np.ndarray]:
    rec.resolve()
    rec.merge_threads()
    comm_rows = rec.collectives.take_rows(0, rec.records, rec.session.intern)
    return rec.take_rows(0), comm_rows


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A gloo group of one process: c10d's ops run through the dispatcher as with N."""
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("async_op", [False, True])
def test_a_collective_is_comm_and_its_output_is_read_afresh_by_its_consumer(
        one_rank_group: None, async_op: bool) -> None:
    with recording() as rec:
        x = torch.arange(6, dtype=torch.float32) * 2
        work = dist.all_reduce(x, async_op=async_op)
        if work is not None:
            work.wait()
        cached_after_collective = id(x) in rec.cache
        y = x + 1
    rows = rec.take_rows(-1)
    ops = names(rec, rows)
    at = ops.index("c10d.allreduce_.default")
    row = rows[at]
    assert int(row["phase"]) == Phase.COMM
    assert int(row["in_fp"]) != 0  # its input, hashed before the call
    assert int(row["out_fp"]) == 0  # nothing read while gloo may still be writing
    assert not cached_after_collective
    # the consumer reads x afresh (an entry point), not the fingerprint from before the call
    after = rows[at + 1:]
    assert [Kind(int(r["kind"])) for r in after] == [Kind.ENTRY, Kind.OP]
    assert int(after[0]["out_fp"]) == int(after[1]["in_fp"])
    assert ops[at + 1] == "comm:c10d.allreduce_.default"  # named after what wrote it
    assert y.sum().item() == sum(2 * i + 1 for i in range(6))  # the program is unchanged


def test_every_tensor_of_a_gather_list_is_forgotten(one_rank_group: None) -> None:
    with recording() as rec:
        x = torch.ones(4) * 3
        out = [torch.zeros(4)]
        outs = [out[0] * 1]
        dist.all_gather(outs, x)
        forgotten = all(id(t) not in rec.cache for t in outs)
    rows = rec.take_rows(-1)
    assert "c10d.allgather_.default" in names(rec, rows)
    assert forgotten


@pytest.mark.parametrize("async_op", [False, True])
def test_the_collective_record_holds_its_output_read_after_the_wait(
        one_rank_group: None, waits_seen: list[OpRecorder], async_op: bool) -> None:
    with recording() as rec:
        waits_seen.append(rec)
        x = torch.arange(6, dtype=torch.float32) * 2
        work = dist.all_reduce(x, async_op=async_op)
        if work is not None:
            work.wait()
        y = x + 1
    rows, comm_rows = _comm_rows(rec)
    at = names(rec, rows).index("c10d.allreduce_.default")
    # the output, read after the wait, is what the consumer read afresh as its entry
    assert int(rows[at]["out_fp"]) != 0
    assert int(rows[at]["out_fp"]) == int(rows[at + 1]["out_fp"])
    assert len(comm_rows) == 1
    row = comm_rows[0]
    assert int(row["index"]) == at
    assert names(rec, rows[at:at + 1]) == ["c10d.allreduce_.default"]
    assert rec.session.intern("gloo") == int(row["backend"])  # already interned: same id
    assert (int(row["group_size"]), int(row["bucket"]), int(row["nbytes"])) == (1, -1, 24)
    assert int(row["output"]) == CommOutput.AFTER_WAIT
    assert y.sum().item() == sum(2 * i + 1 for i in range(6))  # the program is unchanged


def test_a_barriers_uninitialized_tensor_is_never_hashed(
        one_rank_group: None, waits_seen: list[OpRecorder]) -> None:
    with recording() as rec:
        waits_seen.append(rec)
        dist.barrier()  # passes a torch.empty tensor it never writes
    rows, comm_rows = _comm_rows(rec)
    at = names(rec, rows).index("c10d.barrier.default")
    assert int(rows[at]["out_fp"]) == 0  # uninitialized memory is never evidence
    assert int(comm_rows[0]["output"]) == CommOutput.AFTER_WAIT


def test_a_collective_not_waited_for_in_its_step_keeps_no_output(
        one_rank_group: None, waits_seen: list[OpRecorder]) -> None:
    with recording() as rec:
        waits_seen.append(rec)
        x = torch.ones(4)
        work = dist.all_reduce(x, async_op=True)
    rows, comm_rows = _comm_rows(rec)  # the step ends before the script waits
    work.wait()
    at = names(rec, rows).index("c10d.allreduce_.default")
    assert int(rows[at]["out_fp"]) == 0  # in both runs alike, whenever gloo finished
    assert int(comm_rows[0]["output"]) == CommOutput.NOT_READ


def test_ddp_buckets_are_read_after_the_backward_with_index_and_size(
        one_rank_group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    def build() -> tuple[torch.nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)))
        return model, torch.randn(16, 8)

    def train(record: bool) -> tuple[list[torch.Tensor], OpRecorder | None]:
        if not record:
            model, x = build()
            model(x).sum().backward()
            return [_grad(p) for p in model.parameters()], None
        with recording() as rec:
            # built in the window, as at init: the recorder sees the bucket made by `empty`
            # and not the reducer's C++ copies of the gradients into it
            model, x = build()
            rec.collectives.is_ddp_model = lambda: True
            model(x).sum().backward()
            rec.collectives.backward_done()  # what TorchBackend._after_backward calls
        return [_grad(p) for p in model.parameters()], rec

    plain, _ = train(record=False)
    grads, rec = train(record=True)
    assert rec is not None
    rows, comm_rows = _comm_rows(rec)
    buckets = [r for r in comm_rows if int(r["bucket"]) >= 0]
    assert [int(r["bucket"]) for r in buckets] == [0]
    bucket = buckets[0]
    assert int(bucket["nbytes"]) == (8 * 4 + 4 + 4 + 1) * 4  # every gradient, float32
    assert int(bucket["output"]) == CommOutput.AFTER_BACKWARD
    assert int(rows[int(bucket["index"])]["out_fp"]) != 0
    assert int(rows[int(bucket["index"])]["in_fp"]) != 0  # the gradients, not "unset"
    assert int(rows[int(bucket["index"])]["phase"]) == Phase.COMM
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.clone()


class _FakeWork:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self) -> bool:
        self.log.append("wait")
        return True


class _FakeCudaTensor:
    is_cuda = True


def test_on_cuda_the_hash_is_queued_after_the_collectives_stream_work() -> None:
    """NCCL path with CUDA faked: the current stream is ordered after the work (its wait,
    an event wait on the device) before the hash is queued; nothing synchronizes."""
    import contextlib
    import weakref

    from nondet.frameworks.fp import Fp

    log: list[str] = []
    tensors = [_FakeCudaTensor()]

    def fingerprint(t: object) -> Fp:
        log.append("hash")
        return Fp(value=7)

    calls = comm.Collectives(fingerprint, contextlib.nullcontext, lambda: True)
    outs: list[Fp] = []
    calls.launched.append(comm.Launched(outs=outs, tensors=[weakref.ref(tensors[0])],
                                        work=_FakeWork(log), backend="nccl", group_size=8,
                                        nbytes=1 << 20, bucket=0))
    calls.backward_done()
    assert log == ["wait", "hash"]
    assert calls.launched[0].output == CommOutput.ON_DEVICE and len(outs) == 1
    assert not comm_cuda.order_after(_FakeWork(log), [torch.ones(1)])  # CPU: no wait
    assert log == ["wait", "hash"]


def test_a_functional_collectives_wait_is_read_after_it_never_before(
        one_rank_group: None) -> None:
    functional = torch.ops._c10d_functional
    with recording() as rec:
        x = torch.arange(5, dtype=torch.float32)
        group = dist.group.WORLD
        assert group is not None
        y = functional.all_reduce(x, "sum", group.group_name)
        z = functional.wait_tensor(y) * 2  # as compiled code and DTensor's internals wait
    rows, comm_rows = _comm_rows(rec)
    ops = names(rec, rows)
    at = ops.index("_c10d_functional.wait_tensor.default")
    assert int(rows[at]["in_fp"]) == 0  # not read while the collective may be writing it
    assert int(rows[at]["out_fp"]) != 0  # read once the wait returned
    waited = next(r for r in comm_rows if int(r["index"]) == at)
    assert int(waited["output"]) == CommOutput.AFTER_WAIT
    assert torch.equal(z, torch.arange(5, dtype=torch.float32) * 2)
