"""Faults, thirteenth round (FINDINGS.md), and items left by the twelfth."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli, tiny_training


def test_a_script_that_closed_its_standard_streams_is_named_by_its_exception(
        tmp_path: Path) -> None:
    """Left by faults round 12: a script that closes file descriptors 0-2 (a daemonizing
    helper, a logger taking over the streams) and then raises was reported as "the script
    failed in run a (exit code 1)" with no exception line: nondet's own write of the
    traceback to the closed stderr raised, and the run never sent how it ended."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training() + "import os, sys\n"
                      "sys.stdout.flush(); sys.stderr.flush()\n"
                      "os.close(0); os.close(1); os.close(2)\n"
                      "raise ValueError('bad config value')\n")
    result = run_cli("run", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    error = next(line for line in result.stderr.splitlines() if line.startswith("nondet: error"))
    assert "ValueError: bad config value" in error, error


def test_a_script_that_set_stderr_to_none_is_named_by_its_exception(tmp_path: Path) -> None:
    """The same with ``sys.stderr = None`` (what pythonw and some daemons leave)."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training() + "import sys\nsys.stderr = None\n"
                      "raise KeyError('missing_column')\n")
    result = run_cli("run", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    error = next(line for line in result.stderr.splitlines() if line.startswith("nondet: error"))
    assert "KeyError: 'missing_column'" in error, error
