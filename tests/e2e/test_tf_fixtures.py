"""Every TensorFlow fixture through the real CLI: the exact finding, the fix id, the exit
code. The expected findings are declared by the fixtures (tests/e2e/fixture_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FIXTURES, REPO, run_cli
from tests.e2e.fixture_cases import Case, cases, check_declarations, check_finding, run_case

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.e2e, pytest.mark.tensorflow]

CASES = cases(FIXTURES / "tensorflow")


def test_every_fixture_declares_its_expectation() -> None:
    check_declarations(FIXTURES / "tensorflow", CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fixture(case: Case, tmp_path: Path) -> None:
    found = check_finding(case, *run_case(case, tmp_path))
    if found is None:
        return
    assert found["localized"] and found["op_index"] is not None
    if found["kind"] == "op":
        # graph outputs are hashed in the graph: the report says sizes were not measured
        assert found["mismatched_elements"] is None
        assert "sizes are not measured for TensorFlow ops" in found["notes"]


def test_capture_does_not_make_a_deterministic_conv_net_diverge(tmp_path: Path) -> None:
    # The benchmark's Keras CNN repeats exactly when run plainly. Capture once made it
    # diverge within a few steps: lowered tf.cond guards held tensors for a timing-dependent
    # while, which changed which input buffer AddN reused and so its summation order
    # (tensorflow/ops.py, Note [Graph instrumentation]).
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "bench/model_tf.py",
                     "--steps", "8", cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("nondet: deterministic"), result.stdout
