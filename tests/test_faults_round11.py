"""Faults, eleventh round (FINDINGS.md), and the items left from the tenth."""

from __future__ import annotations

from pathlib import Path

import pytest

from nondet import importpath
from tests.conftest import run_cli, tiny_training


@pytest.mark.parametrize("failure", [
    "AttributeError: module 'nondet' has no attribute 'helper'",
    "ImportError: cannot import name 'helper' from 'nondet' (/x/nondet/__init__.py)",
    "ModuleNotFoundError: No module named 'nondet.utils'",
])
def test_a_failure_reaching_for_the_scripts_own_nondet_module_gets_the_hint(
        failure: str) -> None:
    assert importpath.shadowed_hint(failure) == importpath.SHADOWED_HINT


@pytest.mark.parametrize("failure", [
    "AttributeError: module 'numpy' has no attribute 'helper'",
    "ModuleNotFoundError: No module named 'nondetx'",
    "RuntimeError: nondet step failed",
])
def test_other_failures_get_no_such_hint(failure: str) -> None:
    assert importpath.shadowed_hint(failure) == ""


@pytest.mark.e2e
def test_a_scripts_own_nondet_module_is_named_when_the_run_fails(tmp_path: Path) -> None:
    """Trial (faults round 10): a project's ``nondet.py`` beside the script is hidden by
    nondet's package, imported first in a recorded run; plain python runs the script.
    The failure said only "the script failed" with the AttributeError."""
    project = tmp_path / "project"  # not the working directory: ``python -m nondet`` there
    project.mkdir()  # would run the project's module itself, as Python does
    (project / "nondet.py").write_text("def helper():\n    return 3\n")
    (project / "train.py").write_text("import nondet\n" + tiny_training().replace(
        "torch.manual_seed(0)", "torch.manual_seed(nondet.helper())"))
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"),
                   str(project / "train.py"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    first = done.stderr.splitlines()[0]
    assert "module 'nondet' has no attribute 'helper'" in first, done.stderr
    assert importpath.SHADOWED_HINT in first, done.stderr
