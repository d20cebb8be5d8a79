"""nondet's NONDET_* durations: a value that is not a positive number of seconds is one
line and exit 2, before anything runs (trials: NONDET_PROBE_SECONDS=abc was an internal
error, exit 3; =-1 called a good capture damaged; NONDET_IDLE_AFTER=10m was silently 600)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nondet import settings
from nondet.errors import NondetError
from tests.conftest import REPO, run_cli

STEPS = str(REPO / "tests" / "data" / "scripts" / "steps.py")


@pytest.mark.parametrize("text", ["abc", "10m", "-1", "0", "nan"])
def test_a_duration_that_is_not_positive_seconds_is_refused(
        monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("NONDET_IDLE_AFTER", text)
    with pytest.raises(NondetError, match=r"NONDET_IDLE_AFTER=.* is not a duration"):
        settings.check()


@pytest.mark.parametrize("text,seconds", [("", 600.0), ("2.5", 2.5), (" 30 ", 30.0),
                                          ("inf", float("inf"))])
def test_a_duration_in_seconds_is_taken(monkeypatch: pytest.MonkeyPatch, text: str,
                                        seconds: float) -> None:
    monkeypatch.setenv("NONDET_IDLE_AFTER", text)
    assert settings.seconds("NONDET_IDLE_AFTER") == seconds


@pytest.mark.parametrize("variable,command", [
    ("NONDET_PROBE_SECONDS", ["diff", STEPS, STEPS]),
    ("NONDET_IDLE_AFTER", ["run", "--no-verify", STEPS]),
])
def test_the_cli_says_which_setting_is_wrong_before_anything_runs(
        tmp_path: Path, variable: str, command: list[str]) -> None:
    result = run_cli(*command, cwd=tmp_path, env={variable: "10m"}, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"nondet: error: {variable}='10m' is not a duration: give a number of seconds greater "
        f"than 0 (default {settings.DURATIONS[variable]:g}), or unset it"]
