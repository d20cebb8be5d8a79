"""Item 5 of issue 11: an unseeded generator made inside a library is named in the finding,
and the first fix suggested is the one that reaches that generator (the clock-seed fixture,
item 4, runs with the other torch fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "data" / "scripts" / "library_rng.py"


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_a_library_generator_is_named_and_its_seed_comes_first(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "--json", str(report_path),
                     str(SCRIPT.relative_to(REPO)), cwd=REPO)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    found = report["first_divergence"]
    script = SCRIPT.relative_to(REPO)
    assert (found["kind"], found["step"], found["entry_kind"]) == ("entry", 0, "numpy")
    assert found["source"] == f"{script}:{_line(SCRIPT, 'torch.from_numpy(jitter(')}"
    library = REPO / "tests" / "data" / "fakeaug" / "__init__.py"
    site = (f"fakeaug/__init__.py:{_line(library, 'np.random.default_rng(seed)')} in fakeaug, "
            f"made from {script}:{_line(SCRIPT, 'else Jitter(scale=0.1)')}")
    assert any(site in note for note in found["notes"]), found["notes"]
    first = report["suggestions"][0]
    assert first["id"] == "PY-LIB-GENERATOR", [s["id"] for s in report["suggestions"]]
    assert first["details"] == [f"unseeded generator at {site}"]  # only the library's own
