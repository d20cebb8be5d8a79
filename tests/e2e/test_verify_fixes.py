"""Fix verification end to end: `nondet run` re-runs a nondeterministic fixture with its
suggested fix applied from outside, and the fix the fixture declares is verified first.

One fixture per kind of intervention (a switch, a torch patch, a tf.data patch); each costs
two extra runs of a small script.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FIXTURES, REPO, run_cli
from tests.e2e.fixture_cases import cases, check_finding, run_case

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("script", "intervention"), [
    ("torch/index_put_backward.py", "torch.use_deterministic_algorithms(True)"),
    ("torch/dataloader_unordered.py", "every DataLoader made with in_order=True"),
    ("tensorflow/tfdata_options.py", "with_options() made deterministic=True"),
    ("torch/clock_seed.py", "every seeding call (torch.manual_seed"),  # pinned, not edited
])
def test_the_declared_fix_is_verified(script: str, intervention: str, tmp_path: Path) -> None:
    pytest.importorskip("tensorflow" if script.startswith("tensorflow") else "torch")
    path = FIXTURES / script
    case = next(c for c in cases(path.parent) if c.script == path and not c.args)
    result, report = run_case(case, tmp_path, verify=True)
    check_finding(case, result, report)  # the declared finding, its fix first
    assert report is not None
    first = report["suggestions"][0]
    assert first["verified"] is True, first["verify_note"]
    assert intervention in first["verify_note"]
    assert first["verified_steps"] >= 2
    assert first["cost_ratio"] is not None and first["cost_ratio"] > 0
    assert "verified: with" in result.stdout and "x step time" in result.stdout
    # the verification pair's captures are listed with the others
    assert any("run-a-fix1.h5" in c for c in report["captures"])


def test_check_apply_runs_the_pair_with_the_fix(tmp_path: Path) -> None:
    """`nondet check --apply FIX_ID` (a fix checked by hand or held in CI): the fixture
    that parts without it repeats with it."""
    pytest.importorskip("torch")
    result = run_cli("check", "--apply", "torch.deterministic", "--out", str(tmp_path / "out"),
                     str((FIXTURES / "torch" / "index_put_backward.py").relative_to(REPO)),
                     cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
