"""The pipeline driven by fake runs: no subprocess.

``FakeSchedule`` stands in for ``schedule.create``: each run it is asked for is a capture
written at once, from what a ``Script`` says the training script does under that run's plan
(which steps have op-level records, where it stops, which op's outputs it saves). Failures
go through the real ``schedule.check_result``. The tests look at what the pipeline asked
for (the plans) and at the report it built. Runs that fail or stop use the real lockstep
schedule with the thread-backed fake runs of tests/test_schedule.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nondet import pipeline, schedule
from nondet.errors import NondetError, ScriptFailed
from nondet.exitcodes import ExitCode
from nondet.launch import Plan, RunResult, Target
from nondet.records import INIT_STEP, TENSOR_DTYPE, Group, Kind, Phase
from nondet.report import Report
from nondet.store import CaptureWriter
from tests.conftest import OpStream, source_texts, step_rows
from tests.test_schedule import Pair
from tests.test_schedule import Script as ThreadScript

BOUND = 60.0  # seconds any pipeline call below may take; they take well under 5

TRAIN = """import torch
model = torch.nn.Linear(4, 4)
out = model(x)  # line 3
table.index_put_(idx, out, accumulate=True)  # line 4
for batch in loader:  # line 5
    y = model(batch)  # line 6
"""


@dataclass
class Script:
    """What the fake training script does. Run b (every run whose label starts with
    ``differs_in``) differs from run a from step ``differ_at`` on: at an op
    (``aten.index_put``, line 4) or, with ``data``, in the batch that enters (line 5)."""

    steps: int = 6
    differ_at: int | None = None
    data: bool = False
    differs_in: str = "b"  # the runs whose label starts with this differ
    quiet_in: tuple[str, ...] = ()  # ... except these (a race that did not strike there)
    env: dict[str, str] = field(default_factory=dict)  # their environment differs so
    ops_note: str | None = None  # the op-recording runs' backend notes this on its capture
    ops_note_all: bool = False  # ... and so does every other run's


@dataclass
class FakeSchedule:
    """``schedule.Schedule`` over captures written from a ``Script`` (module docstring)."""

    root: Path
    script: Script
    plans: list[Plan] = field(default_factory=list)

    def run_pair(self, plans: tuple[Plan, Plan], judge: schedule.Judge = schedule.never_stop,
                 on_hold: Any = None) -> tuple[RunResult, RunResult]:
        a, b = (schedule.check_result(self._run(p)) for p in plans)
        return a, b

    def run_single(self, plan: Plan) -> RunResult:
        return schedule.check_result(self._run(plan))

    def _run(self, plan: Plan) -> RunResult:
        self.plans.append(plan)
        path = self.root / f"{plan.label}-{len(self.plans)}.h5"
        last = self.script.steps - 1 if plan.stop_after is None \
            else min(plan.stop_after, self.script.steps - 1)
        steps = range(INIT_STEP, last + 1)
        window = list(steps) if plan.op_steps is None else plan.op_steps
        differ_at = self.script.differ_at
        differs = [plan.label.startswith(self.script.differs_in) and differ_at is not None
                   and plan.label not in self.script.quiet_in and s >= differ_at
                   for s in steps]
        ops, tensors = OpStream(), []
        label = ops.sid("dataloader:batch from DataLoader#0")  # no user frame: no "@ line"
        for s, d in zip(steps, differs, strict=True):
            batch = 30 + s + (1000 if d and self.script.data else 0)
            if s >= 0:
                tensors.append((s, int(Group.DATA), label, batch, 0.0, 0.0, 4))
            if s not in window:
                continue
            if s >= 0:
                ops.add(s, "dataloader:batch from DataLoader#0", batch, kind=Kind.ENTRY,
                        phase=Phase.DATA, source="train.py:5")
            ops.add(s, "aten.mm.default", 10 + s, batch, module="", source="train.py:3")
            ops.add(s, "aten.index_put.default",
                    20 + s + (1000 if d and not self.script.data else 0), 10 + s,
                    module="table", source="train.py:4", phase=Phase.BACKWARD)
        rows = step_rows(*({"step": s, "data_fp": 30 + s + (1000 if d and self.script.data
                                                             else 0),
                            "params_fp": s + 2 + (1000 if d else 0)}
                           for s, d in zip(steps, differs, strict=True)))
        writer = CaptureWriter(path, {"label": plan.label, "cwd": str(self.root), "seed": 0,
                                      "op_steps": "all" if plan.op_steps is None
                                      else plan.op_steps})
        writer.add_env({"torch_version": "2.13.0", "python_version": "3.11.7",
                        **(self.script.env if plan.label.startswith(self.script.differs_in)
                           else {})})
        writer.add_facts({"framework": "torch"})
        if self.script.ops_note and (plan.label.endswith("-ops") or self.script.ops_note_all):
            writer.add_facts({"capture_note.fake": self.script.ops_note})
        writer.add_strings(ops.strings + source_texts(ops.strings, self.root))
        for s in sorted({r[0] for r in ops.rows}):
            writer.add_ops(ops.array(s))
        writer.add_tensors(np.array(tensors, dtype=TENSOR_DTYPE))
        for i in range(len(rows)):
            writer.add_step(rows[i : i + 1])
        if plan.dump is not None:
            step, index = plan.dump
            value = np.arange(8, dtype=np.float32)
            if differs[step - INIT_STEP]:
                value[[2, 5]] += 1.0
            writer.add_dump(f"{plan.label}-out0", value, {"step": step, "index": index})
        status = "complete" if plan.stop_after is None or last < plan.stop_after else "stopped"
        writer.close(status, 0)
        return RunResult(label=plan.label, path=path, log_path=self.root / "none.log",
                         status=status, exit_code=0, steps=last + 1)


class Progress:
    def stage(self, text: str) -> None:
        pass

    def status(self, text: str) -> None:
        pass


def _bounded(fn: Callable[[], Report]) -> Report:
    """Run ``fn`` in a thread; fail (instead of hanging) if it takes longer than BOUND."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), f"the pipeline still waits after {BOUND} s"
    if "error" in box:
        raise box["error"]
    result: Report = box["value"]
    return result


def _diagnose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: Script,
              **options: Any) -> tuple[Report, FakeSchedule]:
    (tmp_path / "train.py").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    fake = FakeSchedule(tmp_path, script)
    monkeypatch.setattr(pipeline, "_schedule", lambda *_args: fake)
    opts = pipeline.Options(out_dir=tmp_path / ".nondet", **options)
    report = _bounded(lambda: pipeline.diagnose(Target("train.py", None), opts, Progress()))
    return report, fake


def test_runs_that_match_are_deterministic_after_one_pair(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, fake = _diagnose(tmp_path, monkeypatch, Script())
    assert report.verdict == "deterministic" and report.exit_code == ExitCode.DETERMINISTIC
    assert report.first_divergence is None and report.suggestions == []
    assert [p.label for p in fake.plans] == ["a", "b"]
    assert fake.plans[0].op_steps == pipeline.DEFAULT_OP_STEPS
    assert [r.steps for r in report.runs] == [6, 6]
    assert report.command == "train.py" and len(report.captures) == 2


def test_a_later_step_is_narrowed_down_to_its_op_and_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, fake = _diagnose(tmp_path, monkeypatch, Script(differ_at=3))
    # the first pair records ops of init and step 0 only; the re-runs record steps 2 and 3
    assert [(p.label, p.op_steps) for p in fake.plans[2:4]] == [("a-ops", [2, 3]),
                                                                ("b-ops", [2, 3])]
    div = report.first_divergence
    assert report.verdict == "nondeterministic" and div is not None
    assert (div.step, div.phase, div.op, div.module, div.source) == (
        3, "backward", "aten.index_put.default", "table", "train.py:4")
    assert div.source_text.startswith("table.index_put_(idx, out")
    assert any("op-level recording was re-run" in n for n in div.notes)
    # then two runs save that op's outputs, and the report counts what differs
    assert [(p.label, p.dump) for p in fake.plans[4:]] == [("a-dump", (3, 2)),
                                                           ("b-dump", (3, 2))]
    assert (div.numel, div.mismatched_elements, div.max_abs_diff) == (8, 2, 1.0)
    assert not any("intermittent" in n or "not measured" in n for n in div.notes)
    assert report.suggestions and report.suggestions[0].recipe.id == "PT-GETITEM-CPU"
    assert len(report.captures) == 6 and len(report.growth) >= 1


def test_a_second_narrowing_try_writes_captures_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # h-realtf2: the second try reused the labels a-ops/b-ops, so its runs wrote the files
    # of the first try (run-a-ops.h5), still open: "cannot write ...: unable to truncate a
    # file which is already open", exit 2
    report, fake = _diagnose(tmp_path, monkeypatch, Script(differ_at=3, quiet_in=("b-ops",)))
    labels = [p.label for p in fake.plans]
    assert len(labels) == len(set(labels)), labels
    assert [p.op_steps for p in fake.plans[2:6]] == [[2, 3], [2, 3], None, None]
    div = report.first_divergence
    assert report.verdict == "nondeterministic" and div is not None
    assert (div.step, div.op) == (3, "aten.index_put.default")


@pytest.mark.parametrize("in_every_run", [False, True])
def test_what_the_narrowing_runs_note_on_their_capture_reaches_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_every_run: bool) -> None:
    # h-realtf2: the XLA note (ops in jit_compile functions not recorded one by one) is
    # written only by runs with op-level recording, and no report showed it; a note every
    # run wrote is said once, with the finding
    note = "ops inside XLA-compiled functions are not recorded one by one"
    report, _ = _diagnose(tmp_path, monkeypatch,
                          Script(differ_at=3, ops_note=note, ops_note_all=in_every_run))
    div = report.first_divergence
    assert report.verdict == "nondeterministic" and div is not None
    assert div.notes.count(note) == 1 and note not in report.notes


def test_a_difference_at_step_0_needs_no_narrowing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, fake = _diagnose(tmp_path, monkeypatch, Script(differ_at=0))
    assert [p.label for p in fake.plans] == ["a", "b", "a-dump", "b-dump"]
    div = report.first_divergence
    assert div is not None and (div.step, div.op) == (0, "aten.index_put.default")


def test_a_run_that_fails_in_one_run_only_is_exit_2_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    pair = Pair(tmp_path, ThreadScript(), ThreadScript(fail_at=2))
    monkeypatch.setattr(pipeline, "_schedule", lambda *_args: pair.lockstep())
    opts = pipeline.Options(out_dir=tmp_path / ".nondet")
    with pytest.raises(ScriptFailed, match=r"the script failed in run b .*ValueError: boom "
                       r"in run b") as failed:
        _bounded(lambda: pipeline.diagnose(Target(str(tmp_path / "train.py"), None), opts,
                                           Progress()))
    assert failed.value.exit_code == ExitCode.USAGE == 2


def test_runs_stopped_by_max_steps_compare_the_steps_they_have(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    pair = Pair(tmp_path, ThreadScript(steps=6), ThreadScript(steps=6))
    monkeypatch.setattr(pipeline, "_schedule", lambda *_args: pair.lockstep())
    opts = pipeline.Options(out_dir=tmp_path / ".nondet", max_steps=2)
    report = _bounded(lambda: pipeline.diagnose(Target(str(tmp_path / "train.py"), None),
                                                opts, Progress()))
    assert report.verdict == "deterministic"
    assert [(r.status, r.steps) for r in report.runs] == [("stopped", 2), ("stopped", 2)]


def test_a_run_against_a_baseline_names_the_step_and_the_baseline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    fake = FakeSchedule(tmp_path, Script(differ_at=2, differs_in="a"))
    monkeypatch.setattr(pipeline, "_schedule", lambda *_args: fake)
    target, stored = Target("train.py", None), tmp_path / "base.h5"
    steps, size = pipeline.write_baseline(
        target, pipeline.Options(out_dir=tmp_path / ".nondet"), Progress(), stored)
    assert steps == 6 and size == stored.stat().st_size
    report = _bounded(lambda: pipeline.against_baseline(
        target, pipeline.Options(out_dir=tmp_path / ".nondet"), Progress(), stored,
        allow_drift=False))
    # one run, step-level only (a baseline holds no op records)
    assert [(p.label, p.op_steps) for p in fake.plans] == [("baseline", []), ("a", [])]
    div = report.first_divergence
    assert report.verdict == "nondeterministic" and div is not None and div.step == 2
    assert report.baseline == str(stored) and report.captures[0] == str(stored)
    assert any(f"compared with the baseline {stored}" in n for n in div.notes)
    assert [r.label for r in report.runs] == ["baseline", "a"]


def test_a_run_that_matches_its_baseline_passes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    fake = FakeSchedule(tmp_path, Script())
    monkeypatch.setattr(pipeline, "_schedule", lambda *_args: fake)
    target, stored = Target("train.py", None), tmp_path / "base.h5"
    pipeline.write_baseline(target, pipeline.Options(out_dir=tmp_path / ".nondet"),
                            Progress(), stored)
    report = _bounded(lambda: pipeline.against_baseline(
        target, pipeline.Options(out_dir=tmp_path / ".nondet"), Progress(), stored,
        allow_drift=False))
    assert report.verdict == "deterministic" and report.first_divergence is None
    assert report.notes == [] and report.suggestions == []


def test_data_that_enters_at_a_later_step_is_narrowed_down_to_its_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step rows name the batch but not where it entered (no user frame when the loop
    is in a library); the op records of a re-run with that step in the window do."""
    report, fake = _diagnose(tmp_path, monkeypatch, Script(differ_at=3, data=True))
    div = report.first_divergence
    assert report.verdict == "nondeterministic" and div is not None
    assert (div.kind, div.step, div.phase, div.entry_kind, div.op) == (
        "entry", 3, "data", "dataloader", "batch from DataLoader#0")
    assert [(p.label, p.op_steps) for p in fake.plans[2:4]] == [("a-ops", [2, 3]),
                                                                ("b-ops", [2, 3])]
    assert div.source == "train.py:5" and div.source_text.startswith("for batch in loader")
    assert report.suggestions and report.suggestions[0].recipe.id.startswith("DATA-")


def test_environment_drift_from_the_baseline_is_refused_then_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    fake = FakeSchedule(tmp_path, Script(differ_at=1, differs_in="a",
                                         env={"torch_version": "2.14.0"}))
    monkeypatch.setattr(pipeline, "_schedule", lambda *_args: fake)
    target, stored = Target("train.py", None), tmp_path / "base.h5"
    pipeline.write_baseline(target, pipeline.Options(out_dir=tmp_path / ".nondet"),
                            Progress(), stored)
    with pytest.raises(NondetError, match=r"torch_version \(baseline 2\.13\.0, now 2\.14\.0\)"
                       r".*--allow-env-drift"):
        pipeline.against_baseline(target, pipeline.Options(out_dir=tmp_path / ".nondet"),
                                  Progress(), stored, allow_drift=False)
    report = _bounded(lambda: pipeline.against_baseline(
        target, pipeline.Options(out_dir=tmp_path / ".nondet"), Progress(), stored,
        allow_drift=True))
    div = report.first_divergence
    assert div is not None and div.step == 1
    assert report.environment_drift == [{"key": "torch_version", "a": "2.13.0", "b": "2.14.0"}]
    assert div.notes[-1] == ("possibly caused by the environment drift: torch_version "
                             "(baseline 2.13.0, now 2.14.0)")


@dataclass
class FullDiskSchedule(FakeSchedule):
    """Runs whose label ends with one of ``full_for`` find no room for their capture."""

    full_for: tuple[str, ...] = ()

    def _run(self, plan: Plan) -> RunResult:
        result = super()._run(plan)
        if plan.label.endswith(self.full_for):
            return replace(result, status="stopped",
                           write_error=f"no space left on /out while writing {result.path}")
        return result


@pytest.mark.parametrize("full_for", [("-ops",), ("-dump",)], ids=["narrowing", "measuring"])
def test_a_full_disk_after_the_first_pair_keeps_its_finding(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_for: tuple[str, ...]) -> None:
    """Faults round 11: the re-runs after the first pair found a difference, on a disk with
    no room for them, ended "no space left" (exit 2) and the difference the first two runs
    had shown was lost. The report keeps what was found, and says what stopped."""
    (tmp_path / "train.py").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    fake = FullDiskSchedule(tmp_path, Script(differ_at=3), full_for=full_for)
    monkeypatch.setattr(pipeline, "_schedule", lambda *_args: fake)
    opts = pipeline.Options(out_dir=tmp_path / ".nondet", verify=False)
    report = _bounded(lambda: pipeline.diagnose(Target("train.py", None), opts, Progress()))
    div = report.first_divergence
    assert report.exit_code == ExitCode.NONDETERMINISTIC and div is not None
    assert div.step == 3, div
    said = " ".join(div.notes)
    assert "no space left on /out" in said, div.notes
    if full_for == ("-dump",):  # narrowed to its op; only its sizes were not measured
        assert (div.op, div.source) == ("aten.index_put.default", "train.py:4")
        assert "sizes not measured" in said
