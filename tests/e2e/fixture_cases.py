"""The fixtures' own declarations of what nondet must find, and the check against a report.

Each fixture declares its expectation in its docstring (``Expected: kind=..., step=...,
phase=..., op=..., module=..., fix=...``, and ``Expected[<args>]: ...`` for its variants)
and marks the source line to be reported with ``# nondet: expected-source`` (or
``# nondet: expected-source[<args>]``). ``step=any`` accepts any step, ``step=init`` the
state before the first step. An optional ``node=`` names a TensorFlow graph node; Keras'
``_1``-style uniquifying suffixes are ignored in the comparison.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import REPO, run_cli

_EXPECTED = re.compile(r"^Expected(?:\[(?P<args>[^\]]*)\])?: (?P<body>.*?)\s*$")
_MARKER = re.compile(r"# nondet: expected-source(?:\[(?P<args>[^\]]*)\])?\s*$")


@dataclass(frozen=True)
class Case:
    script: Path
    args: tuple[str, ...]
    expected: dict[str, str]
    source_line: int | None

    @property
    def id(self) -> str:
        return " ".join([self.script.name, *self.args])


def cases(folder: Path) -> list[Case]:
    found = []
    for script in sorted(folder.glob("*.py")):
        lines = script.read_text().splitlines()
        markers = {}
        for number, line in enumerate(lines, start=1):
            hit = _MARKER.search(line)
            if hit:
                markers[hit.group("args") or ""] = number
        for line in lines:
            hit = _EXPECTED.match(line)
            if not hit:
                continue
            body = dict(part.split("=", 1) for part in hit.group("body").split(", "))
            args = hit.group("args") or ""
            found.append(Case(script, tuple(shlex.split(args)), body, markers.get(args)))
    return found


def check_declarations(folder: Path, all_cases: list[Case]) -> None:
    assert {c.script.name for c in all_cases} == {p.name for p in folder.glob("*.py")}
    for case in all_cases:
        if case.expected["kind"] != "none":
            assert case.source_line, f"{case.id}: no expected-source marker"
            assert case.expected.get("fix"), f"{case.id}: no expected fix id"


def run_case(
    case: Case, tmp_path: Path, options: Sequence[str] = (), verify: bool = False
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """``nondet run [options]`` on the fixture through the real CLI: its result and JSON
    report (None if none was written). Fix verification (two more runs per fix tried) is
    off unless ``verify``: the fixtures in ``VERIFIED`` cover it, within the time budget."""
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", *([] if verify else ["--no-verify"]), *options, "--out",
                     str(tmp_path / "out"), "--json", str(report_path),
                     str(case.script.relative_to(REPO)), *case.args, cwd=REPO)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return result, report


#: Fixtures (without arguments) whose declared fix ``test_fixture`` also verifies, one per
#: kind of intervention (a switch, a torch patch, a tf.data patch, pinned seeding calls), with
#: the words the fix's verify note must hold. Verifying in the same ``nondet run`` as the
#: finding costs two more runs, not a second invocation of four (tests/e2e/test_verify_fixes.py).
VERIFIED = {
    "torch/index_put_backward.py": "torch.use_deterministic_algorithms(True)",
    "torch/dataloader_unordered.py": "every DataLoader made with in_order=True",
    "tensorflow/tfdata_options.py": "with_options() made deterministic=True",
    "torch/clock_seed.py": "every seeding call (torch.manual_seed",  # pinned, not edited
    "tensorflow/map_fn_noise.py": "built with parallel_iterations=1",  # a TensorFlow patch
}


def intervention_to_verify(case: Case) -> str | None:
    """What the fix's verify note must name, for a case in ``VERIFIED``; else None."""
    if case.args:
        return None
    return VERIFIED.get(case.script.relative_to(REPO / "fixtures").as_posix())


def check_verified(intervention: str, result: subprocess.CompletedProcess[str],
                   report: dict[str, Any] | None) -> None:
    """The declared fix (first suggestion) was applied from outside and the runs repeated."""
    assert report is not None, result.stderr
    first = report["suggestions"][0]
    assert first["verified"] is True, first["verify_note"]
    assert intervention in first["verify_note"]
    assert first["verified_steps"] >= 2
    assert first["cost_ratio"] is not None and first["cost_ratio"] > 0
    assert "verified: with" in result.stdout and "x step time" in result.stdout
    # the verification pair's captures are listed with the others
    assert any("run-a-fix1.h5" in c for c in report["captures"])


def check_draw_note(case: Case, report: dict[str, Any]) -> None:
    """A deterministic case declaring ``note=PT-RNG`` (a draw before the script seeds
    torch) gets that note at its marked line; every other one (seeding first) none."""
    drawn = [n for n in report["notes"] if "[PT-RNG]" in n]
    if case.expected.get("note") == "PT-RNG":
        rel = case.script.relative_to(REPO)
        assert drawn and drawn[0].startswith(f"{rel}:{case.source_line} "), report["notes"]
    else:
        assert not drawn, drawn


def check_finding(case: Case, result: subprocess.CompletedProcess[str],
                  report: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report and exit code say exactly what the fixture declares; returns the finding."""
    assert report is not None, result.stderr
    found: dict[str, Any] | None = report["first_divergence"]
    want = case.expected
    if want["kind"] == "none":
        assert result.returncode == 0, result.stdout + result.stderr
        assert report["verdict"] == "deterministic" and found is None
        check_draw_note(case, report)
        return None
    assert result.returncode == 1, result.stdout + result.stderr
    assert report["verdict"] == "nondeterministic"
    assert found is not None
    assert found["kind"] == want["kind"], result.stdout
    if want["step"] == "any":
        assert isinstance(found["step"], int) and found["step"] >= 0
    elif want["step"] == "init":
        assert found["step"] is None, result.stdout
    else:
        assert found["step"] == int(want["step"]), result.stdout
    assert found["phase"] == want["phase"], result.stdout
    assert found["op"] == want["op"], result.stdout
    assert found["module"] == want["module"], result.stdout
    if "node" in want:
        node = "/".join(re.sub(r"_\d+$", "", part) for part in (found["node"] or "").split("/"))
        assert node == want["node"], result.stdout
    rel = case.script.relative_to(REPO)
    assert found["source"] == f"{rel}:{case.source_line}", result.stdout
    assert report["suggestions"] and report["suggestions"][0]["id"] == want["fix"], result.stdout
    assert result.stdout.startswith("nondet: nondeterministic")
    return found
