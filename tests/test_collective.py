"""The ``collective`` finding of a torchrun job (nondet/collective.py) on crafted captures:
found at the collective's own record when every rank's inputs to it matched, with what the
capture's comm table recorded of the call; not when a rank fed it a difference."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nondet import jobs
from nondet.records import COMM_DTYPE, CommOutput, Phase
from nondet.report import text
from nondet.store import CaptureWriter
from tests.conftest import OpStream, run_cli, step_rows

BUCKET = 25 << 20  # DDP's default bucket_cap_mb


def _rank(path: Path, rank: int, reduced: int, rank1_input: int) -> None:
    """One rank's capture: a matmul, DDP's bucket all-reduce (output ``reduced``, the same on
    both ranks), the optimizer's add; rank 1's bucket input is ``rank1_input``."""
    ops = OpStream()
    ops.add(0, "aten.mm.default", 11 + rank, 7, phase=Phase.FORWARD, source="train.py:9")
    ops.add(0, "c10d.allreduce_.default", reduced, rank1_input if rank else 21,
            phase=Phase.COMM, source="train.py:12")
    ops.add(0, "aten.add_.Tensor", reduced + 1, reduced, phase=Phase.OPTIMIZER,
            source="train.py:13")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = CaptureWriter(path, {"label": path.stem, "seed": 0, "rank": rank,
                                  "world_size": 2, "op_steps": [-1, 0]})
    writer.add_env({"torch_version": "2.13.0"})
    writer.add_facts({"framework": "torch"})
    writer.add_strings([*ops.strings, "gloo"])
    writer.add_ops(ops.array(0))
    writer.add_comm(np.array([(0, 1, len(ops.strings), 2, 0, BUCKET,
                               int(CommOutput.AFTER_BACKWARD))], dtype=COMM_DTYPE))
    writer.add_step(step_rows({"step": 0, "params_fp": reduced + 1, "grads_fp": reduced}))
    writer.close("complete", 0)


def _job(root: Path, label: str, reduced: int, rank1_input: int = 22) -> Path:
    for rank in (0, 1):
        _rank(root / f"run-{label}" / f"rank{rank}.h5", rank, reduced, rank1_input)
    return root / f"run-{label}"


def test_a_bucket_all_reduce_that_made_the_difference_is_named_with_its_bucket(
        tmp_path: Path) -> None:
    report = jobs.diff_dirs(_job(tmp_path, "a", 100), _job(tmp_path, "b", 200))
    div = report.first_divergence
    assert div is not None
    assert (div.kind, div.step, div.phase, div.op, div.rank) == (
        "collective", 0, "comm", "c10d.allreduce_.default", 0)
    assert div.collective is not None
    assert div.collective["summary"] == "gloo, group of 2, bucket 0 of 25 MB"
    assert div.collective["ddp_bucket"] and div.collective["group_size"] == 2
    assert report.suggestions[0].recipe.id == "DIST-PT-DDP-BUCKET"
    headline = text.lines(report)[0]
    assert ("step 0, comm, rank 0: the collective c10d.allreduce_.default creates the "
            "difference: its output differs while every rank's inputs matched (gloo, group "
            "of 2, bucket 0 of 25 MB)") in headline


def test_not_a_collective_finding_when_a_rank_fed_it_a_different_input(
        tmp_path: Path) -> None:
    report = jobs.diff_dirs(_job(tmp_path, "a", 100, rank1_input=22),
                            _job(tmp_path, "b", 200, rank1_input=23))
    div = report.first_divergence
    assert div is not None and div.kind != "collective" and div.collective is None


def test_show_lists_a_steps_collectives(tmp_path: Path) -> None:
    capture = _job(tmp_path, "a", 100) / "rank0.h5"
    shown = run_cli("show", "--ops", "0", str(capture))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "collectives of step 0" in shown.stdout
    row = next(line for line in shown.stdout.splitlines() if "bucket 0 of" in line)
    assert "gloo, group of 2" in row and "read after the backward pass" in row
    assert "25 MB" in shown.stdout
