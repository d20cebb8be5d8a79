"""Faults, tenth round (FINDINGS.md): scripts that change the import machinery nondet's
hooks run under, and more."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli, tiny_training


def test_a_script_that_hides_numpy_from_itself_is_compared(tmp_path: Path) -> None:
    """``sys.modules["numpy"] = None`` (a job that must not use NumPy): nondet's hooks
    imported a part of the store (and NumPy) on the first line they recorded, exit 3
    "internal error: ModuleNotFoundError: import of numpy halted"."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nimport torch\nsys.modules['numpy'] = None\n"
                      + tiny_training(steps=3))
    result = run_cli("run", "-q", "--no-verify", "--ops", "all", str(script), cwd=tmp_path,
                     timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bitwise identical" in result.stdout
