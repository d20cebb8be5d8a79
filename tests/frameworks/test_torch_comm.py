"""Collectives as the torch recorder sees them (frameworks/torch/comm.py): phase comm,
inputs hashed before the call, outputs never read before the work is done."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

import torch
import torch.distributed as dist

from nondet.records import Kind, Phase
from tests.frameworks.test_torch_capture import names, recording


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
