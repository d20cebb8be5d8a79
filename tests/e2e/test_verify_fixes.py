"""Fix verification end to end: `nondet run` re-runs a nondeterministic fixture with its
suggested fix applied from outside, and the fix the fixture declares is verified first.

One fixture per kind of intervention (a switch, a torch patch, a tf.data patch, pinned
seeding calls), listed in ``fixture_cases.VERIFIED``: each fixture's ``test_fixture`` (in
test_torch_fixtures.py, test_tf_fixtures.py) verifies in the same run that checks its
finding, two extra runs of a small script instead of a second ``nondet run``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FIXTURES, REPO, run_cli
from tests.e2e.fixture_cases import VERIFIED, cases, intervention_to_verify

pytestmark = pytest.mark.e2e


def test_every_fixture_to_verify_is_a_case_with_a_declared_fix() -> None:
    # test_fixture (test_torch_fixtures.py, test_tf_fixtures.py) verifies the fix of each
    # fixture in VERIFIED in the run that checks its finding; a key naming no case would
    # verify nothing, silently
    for script in VERIFIED:
        path = FIXTURES / script
        matching = [c for c in cases(path.parent) if c.script == path and not c.args]
        assert len(matching) == 1, script
        assert intervention_to_verify(matching[0]) == VERIFIED[script]
        assert matching[0].expected.get("fix"), script
    kinds = {script.split("/")[0] for script in VERIFIED}
    assert kinds == {"torch", "tensorflow"}


def test_check_apply_runs_the_pair_with_the_fix(tmp_path: Path) -> None:
    """`nondet check --apply FIX_ID` (a fix checked by hand or held in CI): the fixture
    that parts without it repeats with it."""
    pytest.importorskip("torch")
    result = run_cli("check", "--apply", "torch.deterministic", "--out", str(tmp_path / "out"),
                     str((FIXTURES / "torch" / "index_put_backward.py").relative_to(REPO)),
                     cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
