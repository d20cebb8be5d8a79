"""Two captures that cannot be compared give one line and exit 2, never a verdict (trials:
``nondet diff`` of a complete capture and one interrupted before its first step said
"deterministic", exit 0; of a torch capture and a TensorFlow one, "nondeterministic",
exit 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nondet import analysis
from nondet.errors import NondetError
from nondet.report import Report
from nondet.store import CaptureWriter, open_capture
from tests.conftest import step_rows, write_capture

INIT: dict[str, Any] = {"step": -1, "params_fp": 1}
STEPS: list[dict[str, Any]] = [
    INIT, {"step": 0, "loss": 0.5, "loss_fp": 7, "grads_fp": 2, "params_fp": 3},
    {"step": 1, "loss": 0.25, "loss_fp": 8, "grads_fp": 4, "params_fp": 5}]


def _compare(a: Path, b: Path) -> Report:
    return analysis.compare_captures(open_capture(a), open_capture(b))


@pytest.mark.parametrize("status", ["interrupted", "stopped", "crashed"])
def test_a_capture_with_no_step_is_not_compared_with_one_that_has_steps(
        tmp_path: Path, status: str) -> None:
    full = write_capture(tmp_path / "a.h5", step_rows(*STEPS))
    empty = write_capture(tmp_path / "b.h5", step_rows(INIT), status=status)
    for a, b in ((full, empty), (empty, full)):
        with pytest.raises(NondetError, match=r"b\.h5 holds no training step"):
            _compare(a, b)


def test_a_run_that_ended_before_its_first_step_while_the_other_trained_still_differs(
        tmp_path: Path) -> None:
    # both ended on their own: the step counts differ, a finding (not "nothing compared")
    full = write_capture(tmp_path / "a.h5", step_rows(*STEPS))
    empty = write_capture(tmp_path / "b.h5", step_rows(INIT))
    assert _compare(full, empty).verdict == "nondeterministic"


def test_captures_with_steps_in_common_are_compared_as_before(tmp_path: Path) -> None:
    full = write_capture(tmp_path / "a.h5", step_rows(*STEPS))
    short = write_capture(tmp_path / "b.h5", step_rows(*STEPS[:2]), status="interrupted")
    assert _compare(full, short).verdict == "deterministic"


def _tensorflow_capture(path: Path) -> Path:
    writer = CaptureWriter(path, {"label": "a", "cwd": str(path.parent), "seed": 0,
                                  "op_steps": [-1]})
    writer.add_env({"tensorflow_version": "2.21.0", "python_version": "3.11.7"})
    rows = step_rows(*STEPS)
    rows["params_fp"] += 100  # other weights, as another framework's model would have
    for i in range(len(rows)):
        writer.add_step(rows[i : i + 1])
    writer.close("complete", 0)
    return path


def test_a_torch_capture_and_a_tensorflow_capture_are_not_compared(tmp_path: Path) -> None:
    torch_run = write_capture(tmp_path / "a.h5", step_rows(*STEPS))
    tf_run = _tensorflow_capture(tmp_path / "b.h5")
    with pytest.raises(NondetError, match=r"recorded with torch and .*b\.h5 with tensorflow"):
        _compare(torch_run, tf_run)
    assert _compare(tf_run, tf_run).verdict == "deterministic"
    assert np.all(open_capture(tf_run).steps["step"] == [-1, 0, 1])
