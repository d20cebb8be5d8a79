"""Many sub-millisecond steps through the real CLI in lockstep, where turns grant several
steps at once (turns.Grants): the first differing step is found exactly, both runs stop
at the same step, and a deterministic control stays quiet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nondet.analysis import GROWTH_STEPS
from nondet.exitcodes import ExitCode
from nondet.turns import MAX_GRANT
from tests.conftest import REPO, run_cli

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e

MODEL = REPO / "bench" / "model_tiny.py"
ENV = {"OMP_NUM_THREADS": "1"}


def test_a_difference_among_tiny_steps_is_found_at_its_step(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "--json",
                     str(report), str(MODEL), "--steps", "150", "--unseeded-noise",
                     "--noise-step", "60", env=ENV)
    assert result.returncode == ExitCode.NONDETERMINISTIC, result.stderr
    data = json.loads(report.read_text())
    assert data["first_divergence"]["step"] == 60
    assert data["first_divergence"]["kind"] == "entry"  # the NumPy noise, named
    runs = {r["label"]: r for r in data["runs"]}
    assert runs["a"]["status"] == runs["b"]["status"] == "stopped"
    assert runs["a"]["steps"] == runs["b"]["steps"]  # both overshoot the stop alike
    stop = 60 + GROWTH_STEPS + 1  # steps 0..64 judged
    assert stop <= runs["a"]["steps"] <= stop + MAX_GRANT - 1


def test_a_deterministic_script_of_tiny_steps_stays_quiet(tmp_path: Path) -> None:
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), str(MODEL),
                     "--steps", "150", env=ENV)
    assert result.returncode == ExitCode.DETERMINISTIC, result.stdout + result.stderr
    assert "2 runs (150, 150 steps) are bitwise identical" in result.stdout
