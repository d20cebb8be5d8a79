"""The text report against a golden file, and the JSON report against the contract."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from nondet import analysis, recipe
from nondet.records import Flag, Kind, Phase
from nondet.report import text
from nondet.store import open_capture
from tests.conftest import OpStream, step_rows, write_capture

GOLDEN = Path(__file__).parent / "data" / "report_expected.txt"
TRAIN = """import torch
model = torch.nn.Linear(4, 4)
out = table[idx]  # line 3
loss = out.sum()
"""


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "train.py").write_text(TRAIN)

    def ops(differs: bool) -> OpStream:
        s = OpStream()
        s.add(0, "aten.mm.default", 11, 1, module="head", source="train.py:2")
        s.add(0, "aten.sum.default", 12, 11, module="head", source="train.py:4",
              phase=Phase.BACKWARD)
        s.add(0, "aten.new_zeros.default", 13, 12, module="table", source="train.py:3",
              phase=Phase.BACKWARD)
        s.add(0, "aten.index_put.default", 99 if differs else 14, 13, module="table",
              source="train.py:3", phase=Phase.BACKWARD)
        s.add(0, "aten.add_.Tensor", 98 if differs else 15, 99 if differs else 14,
              source="train.py:4", phase=Phase.OPTIMIZER, flags=Flag.INPLACE)
        return s

    steps = [{"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "grads_fp": 2,
                                            "params_fp": 3},
             {"step": 1, "loss": 0.25, "grads_fp": 4, "params_fp": 5}]
    a_steps = step_rows(*steps)
    b_steps = step_rows(*steps)
    b_steps[1]["grads_fp"], b_steps[1]["params_fp"] = 20, 30
    b_steps[2]["loss"], b_steps[2]["grads_fp"], b_steps[2]["params_fp"] = 0.2500001, 40, 50
    env = {"torch_version": "2.13.0", "env.OMP_NUM_THREADS": "(unset)"}
    a = write_capture(tmp_path / "a.h5", a_steps, ops(False), env=env)
    b = write_capture(tmp_path / "b.h5", b_steps, ops(True),
                      env={**env, "env.OMP_NUM_THREADS": "2"})
    return a, b


def _render(tmp_path: Path) -> tuple[str, dict]:
    a, b = _pair(tmp_path)
    ca, cb = open_capture(a), open_capture(b)
    report = analysis.compare_captures(ca, cb)
    report.suggestions = recipe.suggest(
        analysis.finding_facts(report.first_divergence, ca, report.environment_differences))
    report.captures = ["a.h5", "b.h5"]
    out = io.StringIO()
    text.render(report, Console(file=out, width=100, color_system=None, highlight=False,
                                soft_wrap=True))
    return out.getvalue(), report.to_json()


def test_text_report_matches_the_golden_file(tmp_path: Path) -> None:
    rendered, _ = _render(tmp_path)
    if os.environ.get("NONDET_UPDATE_GOLDENS") == "1":
        GOLDEN.write_text(rendered)
        pytest.skip("golden file rewritten")
    assert rendered == GOLDEN.read_text(), "run `make goldens` after an intended change"


def test_json_report_follows_the_contract(tmp_path: Path) -> None:
    _, report = _render(tmp_path)
    json.dumps(report)  # serializable
    assert report["nondet_report_version"] == 1
    assert report["verdict"] == "nondeterministic" and report["exit_code"] == 1
    for run in report["runs"]:
        assert {"path", "exit_code", "steps", "complete"} <= set(run)
    found = report["first_divergence"]
    required = {"kind", "step", "phase", "op", "op_index", "module", "source", "rank",
                "mismatched_elements", "numel", "max_abs_diff"}
    assert required <= set(found)
    assert found["kind"] == "op" and found["step"] == 0 and found["phase"] == "backward"
    assert found["op"] == "aten.index_put.default" and found["op_index"] == 3
    assert found["module"] == "table" and found["source"] == "train.py:3"
    assert report["suggestions"][0]["id"] == "PT-GETITEM-CPU"
    assert {"id", "cause", "fix", "verified"} <= set(report["suggestions"][0])
    assert report["environment_differences"] == [
        {"key": "env.OMP_NUM_THREADS", "a": "(unset)", "b": "2"}]


def test_deterministic_report_has_null_divergence(tmp_path: Path) -> None:
    a, _ = _pair(tmp_path)
    report = analysis.compare_captures(open_capture(a), open_capture(a)).to_json()
    assert report["verdict"] == "deterministic" and report["first_divergence"] is None
    assert report["exit_code"] == 0


def test_entry_kinds_are_reported_as_entries(tmp_path: Path) -> None:
    def ops(fp: int) -> OpStream:
        return (OpStream()
                .add(0, "numpy:torch.from_numpy", fp, kind=Kind.ENTRY, source="train.py:3")
                .add(0, "aten.add.Tensor", fp + 1, fp, source="train.py:4"))

    steps = step_rows({"step": -1}, {"step": 0, "data_fp": 1})
    other = steps.copy()
    other[1]["data_fp"] = 2
    (tmp_path / "train.py").write_text(TRAIN)
    a = write_capture(tmp_path / "a.h5", steps, ops(5),
                      facts={"numpy.unseeded_generator": ["train.py:1"]})
    b = write_capture(tmp_path / "b.h5", other, ops(7))
    ca = open_capture(a)
    report = analysis.compare_captures(ca, open_capture(b))
    div = report.first_divergence
    assert div is not None and div.kind == "entry" and div.entry_kind == "numpy"
    assert div.op == "torch.from_numpy" and div.phase == "forward"
    facts = analysis.finding_facts(div, ca)
    assert recipe.suggest(facts)[0].recipe.id == "PY-NP-GENERATOR"


def test_findings_say_what_a_run_did_without_none_or_a_repeated_init() -> None:
    """Trial round 18: a run whose op stream ended first read "run a executed None", and an
    entry at init "init, init, record #0"."""
    from nondet.exitcodes import ExitCode
    from nondet.report import Divergence, Report

    def shown(div: Divergence) -> str:
        found = Report(verdict="nondeterministic", exit_code=ExitCode.NONDETERMINISTIC,
                       runs=[], first_divergence=div)
        return "\n".join(text.lines(found))

    ended = shown(Divergence("structure", 3, "forward", op=None, op_b="aten.add.Tensor",
                             op_index=12))
    assert "record #12: run a recorded no more ops, run b executed aten.add.Tensor" in ended
    assert "None" not in ended
    entry = shown(Divergence("entry", None, "init", op="weight", op_index=0))
    assert "init, record #0" in entry and "init, init" not in entry
    later = shown(Divergence("entry", 2, "data", op="batch", op_index=0))
    assert "step 2, data, record #0" in later
