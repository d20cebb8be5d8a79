"""Narrowing runs started while the first pair still runs (nondet.live), with the fake
runs of tests/test_schedule.py: a real child Session over real pipes, in a thread."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nondet import channel
from nondet.launch import Plan
from nondet.live import Early, LiveCompare, narrowing_window
from nondet.records import STEP_DTYPE
from nondet.schedule import KEEP_BYTES, Lockstep, never_stop
from nondet.turns import Turns
from tests.test_schedule import BOUND, FakeRun, Script, _bounded, _Recorder, _row


class _Progress:
    def stage(self, text: str) -> None:
        pass

    def status(self, text: str) -> None:
        pass


def _rows(step: int, records: int, differ: bool = True) -> tuple[np.void, np.void]:
    a, b = np.zeros(1, STEP_DTYPE), np.zeros(1, STEP_DTYPE)
    a["step"] = b["step"] = step
    a["n_records"] = b["n_records"] = records
    a["params_fp"], b["params_fp"] = 1, 2 if differ else 1
    return a[0], b[0]


class _Factory:
    def __init__(self, tmp_path: Path, steps: int = 3) -> None:
        self.tmp_path, self.steps = tmp_path, steps
        self.made: list[FakeRun] = []

    def __call__(self, plan: Plan) -> FakeRun:
        run = FakeRun(plan, Script(steps=self.steps), self.tmp_path)
        self.made.append(run)
        return run


def _window_plan(label: str, step: int) -> Plan:
    return Plan(label, narrowing_window(step)[1], lockstep=True, keep_bytes=KEEP_BYTES)


def test_a_difference_at_a_step_without_op_records_starts_the_narrowing_runs(
        tmp_path: Path) -> None:
    FakeRun.log = []
    factory = _Factory(tmp_path)
    early = Early(factory)  # type: ignore[arg-type]
    judge = LiveCompare(_Progress(), early.anticipate).judge
    assert judge(0, *_rows(0, records=0))
    assert [r.plan for r in factory.made] == [_window_plan("a-ops", 0),
                                              _window_plan("b-ops", 0)]
    assert all(r.running() for r in factory.made)
    # the narrowing asks for exactly that plan: it gets the run already started, once
    first = factory.made[0]
    assert early.take(_window_plan("a-ops", 0)) is first
    assert early.take(_window_plan("a-ops", 0)) is None
    # another plan under the same label: the early run is stopped, its files removed
    second = factory.made[1]
    assert early.take(Plan("b-ops", None, lockstep=True, keep_bytes=KEEP_BYTES)) is None
    assert not second.running() and not second.path.exists()
    early.discard()
    first.interrupt()


def test_a_difference_the_first_pair_recorded_op_by_op_starts_nothing(tmp_path: Path) -> None:
    factory = _Factory(tmp_path)
    early = Early(factory)  # type: ignore[arg-type]
    LiveCompare(_Progress(), early.anticipate).judge(0, *_rows(0, records=12))
    assert factory.made == []


def test_early_runs_not_taken_are_stopped_and_their_files_removed(tmp_path: Path) -> None:
    FakeRun.log = []
    factory = _Factory(tmp_path)
    early = Early(factory)  # type: ignore[arg-type]
    early.anticipate(3, *_rows(3, records=0))
    assert len(factory.made) == 2
    _bounded(early.discard)
    for run in factory.made:
        assert not run.running()
        assert not run.path.exists() and not run.log_path.exists()
    early.anticipate(3, *_rows(3, records=0))  # after discard: nothing more starts
    assert len(factory.made) == 2


def test_lockstep_takes_over_runs_that_started_early(tmp_path: Path) -> None:
    """The early runs sent their init row (and wait for their turn) before the schedule
    existed: the schedule's turns replay what they sent and run them to the end."""
    FakeRun.log = []
    factory = _Factory(tmp_path, steps=3)
    early = Early(factory)  # type: ignore[arg-type]
    early.anticipate(0, *_rows(0, records=0))
    started = list(factory.made)
    _bounded(lambda: _wait_for_init(started), BOUND)

    def make_run(plan: Plan) -> FakeRun:
        return early.take(plan) or factory(plan)  # type: ignore[return-value]

    plans = (Plan("a-ops", [-1, 0]), Plan("b-ops", [-1, 0]))
    lockstep = Lockstep(make_run, poll=0.02)  # type: ignore[arg-type]
    # as pipeline._run_pair: with a hold, so runs keep outputs (the plan the early runs have)
    ra, rb = _bounded(lambda: lockstep.run_pair(plans, on_hold=lambda a, b: None))
    assert factory.made == started  # no run was started twice
    assert (ra.status, ra.steps, rb.status, rb.steps) == ("complete", 3, "complete", 3)
    steps = [(label, step) for event, label, step in FakeRun.log if event == "step"]
    assert steps == [(label, k) for k in range(3) for label in ("a-ops", "b-ops")]


def _wait_for_init(runs: list[FakeRun]) -> bool:
    import time

    while not all(r.steps for r in runs):
        time.sleep(0.01)
    return True


def test_turns_replay_rows_sent_before_they_existed_once() -> None:
    a, b = _Recorder("a"), _Recorder("b")
    a.steps, b.steps = [_row(-1)], [_row(-1)]  # type: ignore[attr-defined]
    a.ended = b.ended = False  # type: ignore[attr-defined]
    turns = Turns(a, b, never_stop)  # type: ignore[arg-type]
    assert a.words == [channel.GO] and b.words == []
    turns.on_row(a, _row(-1))  # the pump thread delivers the same row: counted once
    turns.on_row(b, _row(-1))
    assert a.words == [channel.GO] and b.words == []


def test_a_difference_only_in_rng_state_does_not_stop_the_runs() -> None:
    """A Keras random layer in a tf.data map advances its seed state as far as prefetching
    ran ahead: the runs go on (a later difference in training would be missed), and
    stop GROWTH_STEPS after the training state first differs."""
    judge = LiveCompare(_Progress())
    rng_only = _rows(2, records=0, differ=False)
    rng_only[1]["rng_fp"] = 7
    assert all(judge.judge(step, *rng_only) for step in range(2, 30))
    assert judge.first_difference == 2 and judge.training_difference is None
    assert judge.judge(30, *_rows(30, records=0))
    assert judge.training_difference == 30
    assert [judge.judge(s, *_rows(s, records=0)) for s in range(31, 35)] == [True] * 3 + [False]


class _FirstPairRun:
    """What ``Early`` reads of a first-pair run: its strings and data rows as mirrored."""

    def __init__(self, labels: list[str], fps: list[int]) -> None:
        self.strings = ["", *labels]
        self.data_rows = {0: [(i + 1, fp) for i, fp in enumerate(fps)]}


def _data_rows(step: int) -> tuple[np.void, np.void]:
    a, b = _rows(step, records=0)
    a["data_fp"], b["data_fp"] = 5, 6  # the data differs first
    return a, b


@pytest.mark.parametrize("second", ["tf_data:IteratorGetNext @ train.py:9",
                                    "tf_data:IteratorGetNext"])
def test_data_the_step_rows_name_at_its_line_starts_no_narrowing_runs(
        tmp_path: Path, second: str) -> None:
    # The rows name the finding when the first differing entry carries its line
    # (finding._data_entry_divergence; the pipeline then narrows nothing): no runs start.
    # An entry without its line is narrowed: the runs start as before.
    factory = _Factory(tmp_path)
    early = Early(factory)  # type: ignore[arg-type]
    labels = ["external:graph input @ train.py:3", second]
    early.watch("a", _FirstPairRun(labels, [1, 2]))  # type: ignore[arg-type]
    early.watch("b", _FirstPairRun(labels, [1, 3]))  # type: ignore[arg-type]
    early.anticipate(0, *_data_rows(0))
    assert len(factory.made) == (0 if " @ " in second else 2)
    _bounded(early.discard)
