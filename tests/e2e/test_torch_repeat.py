"""Every deterministic torch fixture gives the same op records in repeated captured runs.

The fixtures' own declarations say which cases are deterministic (``Expected...: kind=none``,
the controls and the fixed variants of the nondeterministic fixtures). Each is captured
three times with op-level capture at every step (a few steps only); the record streams
(names, kinds, phases, modules, lines, fingerprints) and step rows must be identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nondet.launch import Target
from tests.conftest import FIXTURES
from tests.e2e.fixture_cases import Case, cases
from tests.frameworks.test_torch_repeat import capture_many, first_difference

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e

# unread_entry.py makes a tensor over uninitialized NumPy memory that nothing reads: its
# training repeats, but that entry's record holds different bytes in every run by design
UNREAD_BY_DESIGN = {"unread_entry.py"}
DETERMINISTIC = [c for c in cases(FIXTURES / "torch") if c.expected["kind"] == "none"
                 and c.script.name not in UNREAD_BY_DESIGN]


def test_there_are_deterministic_fixtures_to_repeat() -> None:
    assert len(DETERMINISTIC) >= 7


@pytest.mark.parametrize("case", DETERMINISTIC, ids=lambda c: c.id)
def test_deterministic_fixture_records_repeat(case: Case, tmp_path: Path) -> None:
    target = Target(str(case.script), None, case.args)
    streams = capture_many(target, tmp_path, runs=3, parallel=3, stop_after=2)
    assert any(r[0] != "step" for r in streams[0]), "no op records were captured"
    for i, stream in enumerate(streams[1:], start=1):
        assert stream == streams[0], f"run {i}: {first_difference(streams[0], stream)}"
