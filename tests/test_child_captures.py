"""Parent side of recorded child processes (nondet/child_captures.py): a child's frames
file stored as a capture beside the run's, and child K of run a compared with run b's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from nondet import channel, child_captures
from nondet.analysis import compare_pair
from nondet.store import open_capture
from tests.conftest import step_rows, write_capture

STEPS = [{"step": s, "params_fp": 10 + s, "loss_fp": 20 + s} for s in (-1, 0, 1, 2)]


def _child_frames(run: Path, index: int, rows: np.ndarray, torn: bool) -> None:
    """What a child process writes: its steps, then END unless it was killed."""
    path = channel.child_frames_path(str(run.parent), f"{run.stem.removeprefix('run-')}"
                                     f".child{index}")
    writer = channel.FrameWriter(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    for row in rows:
        writer.send(channel.STEP, row.tobytes())
    if torn:
        writer.send(channel.STEP, rows[-1].tobytes()[:7])  # killed while writing a frame
    else:
        writer.send_json(channel.END, channel.End(channel.COMPLETE, 0).encode())
    writer.flush()


def test_a_child_killed_while_writing_is_stored_as_crashed_with_its_whole_steps(
        tmp_path: Path) -> None:
    run = write_capture(tmp_path / "run-a.h5", step_rows(*STEPS))
    _child_frames(run, 0, step_rows(*STEPS[:3]), torn=True)
    assert child_captures.store(run) == [tmp_path / "run-a.child0.h5"]
    child = open_capture(tmp_path / "run-a.child0.h5")
    assert child.status == channel.CRASHED and child.n_steps == 2
    assert not (tmp_path / "run-a.child0.frames").exists()  # nondet's own file, done with


def test_the_first_child_whose_training_differs_is_the_finding(tmp_path: Path) -> None:
    a = write_capture(tmp_path / "run-a.h5", step_rows(*STEPS))
    b = write_capture(tmp_path / "run-b.h5", step_rows(*STEPS))
    differing = [dict(s, params_fp=99) if s["step"] == 1 else s for s in STEPS]
    for run, child1 in ((a, STEPS), (b, differing)):
        _child_frames(run, 0, step_rows(*STEPS), torn=False)
        _child_frames(run, 1, step_rows(*child1), torn=False)
        child_captures.store(run)
    found = compare_pair(open_capture(a), open_capture(b))
    assert found.verdict == "nondeterministic"
    div = found.first_divergence
    assert div is not None and div.process == "child#1" and div.step == 1, div
    assert div.step_fields == ["params"], div
