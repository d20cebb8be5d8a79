"""Every torch fixture through the real CLI: the exact finding, the fix id, the exit code.

The expected findings are not written here: each fixture declares them (see
tests/e2e/fixture_cases.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FIXTURES, REPO
from tests.e2e.fixture_cases import (
    Case,
    cases,
    check_declarations,
    check_finding,
    check_verified,
    intervention_to_verify,
    run_case,
)

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e

CASES = cases(FIXTURES / "torch")


def test_every_fixture_declares_its_expectation() -> None:
    check_declarations(FIXTURES / "torch", CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fixture(case: Case, tmp_path: Path) -> None:
    intervention = intervention_to_verify(case)
    result, report = run_case(case, tmp_path, verify=intervention is not None)
    found = check_finding(case, result, report)
    if intervention is not None:
        check_verified(intervention, result, report)
    if found is None or found["kind"] == "seed":
        return  # a seed finding is a call, not a tensor: nothing to measure
    assert found["numel"] and found["numel"] > 0
    if found["op_index"] is not None:
        # How much differs was measured (an intermittent race may give 0 this time); not
        # for a size that entered as a Python value (drawn_width.py: the shapes differ).
        assert found["mismatched_elements"] is not None or found["entry_kind"] == "python_value"
    else:
        # Named from the step-level data records: the race did not recur in the op-level
        # re-runs, which the report must say.
        assert found["kind"] == "entry" and any("step-level" in n for n in found["notes"])


@pytest.mark.parametrize("options", [["--schedule", "sequential"], ["--ops", "all"]],
                         ids=["sequential", "ops-all"])
def test_other_schedules_find_the_same_op(options: list[str], tmp_path: Path) -> None:
    """One run after the other (as on GPU machines), and op capture of every step, reach
    the same finding as the default lockstep schedule."""
    case = next(c for c in CASES if c.script.name == "racy_sum.py" and not c.args)
    result, report = run_case(case, tmp_path, options)
    assert result.returncode == 1, result.stdout + result.stderr
    assert report is not None
    found = report["first_divergence"]
    assert (found["kind"], found["step"], found["phase"], found["op"], found["module"]) == (
        "op", 3, "forward", "fixtures.racy_sum.default", "encoder.mixer")
    assert found["source"] == f"{case.script.relative_to(REPO)}:{case.source_line}"
    assert found["mismatched_elements"] is not None


def test_the_scripts_own_dispatch_mode_is_not_the_place(tmp_path: Path) -> None:
    """Trial: with the script's own ``TorchDispatchMode`` around training (an op counter),
    every op was placed at the mode's ``return func(*args, **kwargs)`` line."""
    default = next(c for c in CASES if c.script.name == "index_put_backward.py"
                   and not c.args)
    case = Case(default.script, ("--user-mode",), default.expected, default.source_line)
    result, report = run_case(case, tmp_path)
    check_finding(case, result, report)  # the op, module and line of the default case
