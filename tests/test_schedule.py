"""Schedules driven by fake runs: no subprocess, but the real child side.

A ``FakeRun`` is a ``CapturedRun`` whose child is a thread running a real
``session.Session`` (the same step boundaries, lockstep waits and ``Session.finish`` as a
captured script) over real pipes; the parent side is CapturedRun's own frame handling.
Every test runs the schedule under a time bound, so a run left waiting fails the test
instead of hanging the suite.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nondet import channel, errors, schedule
from nondet.errors import ScriptFailed
from nondet.launch import CapturedRun, Plan, RunResult, Target
from nondet.records import OP_DTYPE, TENSOR_DTYPE
from nondet.schedule import Lockstep, Run, Sequential, never_stop
from nondet.session import ChildConfig, Session, StopRun

BOUND = 30.0  # seconds any schedule below may take; they all take well under 5


@dataclass
class Script:
    """What the fake script does: ``steps`` training steps, unless it fails, stalls,
    is killed or ends early at some step."""

    steps: int = 4
    fail_at: int | None = None
    killed_at: int | None = None
    stall_at: int | None = None
    stall_until: threading.Event | None = None  # the stall ends when this is set
    step_time: float = 0.01
    differ_at: int | None = None  # from this step on, params differ from the other run
    linger: bool = False  # after its last word, the process does not exit (until interrupted)
    overlap_first_step: bool = False  # says so before its init row, as TensorFlow's backend


class _KeptBackend:
    """Stands in for a framework backend that kept an op's outputs."""

    def kept(self, step: int, index: int) -> list[np.ndarray]:
        return [np.arange(4, dtype=np.float32) + step]


class FakeRun(CapturedRun):
    """A CapturedRun whose child is a thread (see module docstring)."""

    log: list[tuple[str, str, int]] = []  # (event, label, step), shared per test

    def __init__(self, plan: Plan, script: Script, out_dir: Path,
                 computing: list[int] | None = None) -> None:
        super().__init__(Target(None, "fake"), plan, 0, out_dir)
        self.script = script
        self.computing = computing if computing is not None else [0, 0]
        self._interrupt_flag = threading.Event()
        self._child: threading.Thread | None = None
        self.code: int | None = None

    def start(self) -> None:
        if self._child is not None:
            return  # started early (nondet.live), as CapturedRun.start
        self.writer = self._open_writer()
        data_r, data_w = os.pipe()
        ctrl_r, self._ctrl_w = os.pipe()
        config = ChildConfig(label=self.plan.label, seed=0, channel_fd=data_w,
                             control_fd=ctrl_r, lockstep=self.plan.lockstep,
                             keep_bytes=self.plan.keep_bytes, stop_after=self.plan.stop_after)
        self._child = threading.Thread(target=self._run_child, args=(config,), daemon=True)
        self._threads = [threading.Thread(target=self._pump_frames, args=(data_r,),
                                          daemon=True)]
        self._child.start()
        self._threads[0].start()

    def running(self) -> bool:
        return self._child is not None and self._child.is_alive()

    def wait(self, timeout: float | None = None) -> RunResult:
        assert self._child is not None
        self._child.join(timeout)
        if self._child.is_alive():
            raise TimeoutError(self.plan.label)
        return self._collect()

    def cancel(self) -> None:
        pass  # a scripted run has no signal on the way to race a stop word

    def interrupt(self, forward: bool = False) -> RunResult:
        if self._result_cache is not None:
            return self._result_cache
        self._interrupted = True
        self._interrupt_flag.set()
        if self.script.stall_until is not None:
            self.script.stall_until.set()
        self._close_control()  # a child waiting for its turn goes on, and sees the flag
        assert self._child is not None
        self._child.join(10)
        return self._collect()

    def _collect(self) -> RunResult:
        for thread in self._threads:
            thread.join(10)
        self._close_control()
        assert self.code is not None
        return self._result(self.code)

    # -- the child ----------------------------------------------------------------------------
    def _run_child(self, config: ChildConfig) -> None:
        session = Session(config)
        session.backends.append(_KeptBackend())
        script, label = self.script, self.plan.label
        status, code, error = channel.COMPLETE, 0, ""
        none_t, none_o = np.zeros(0, TENSOR_DTYPE), np.zeros(0, OP_DTYPE)
        try:
            if script.overlap_first_step:
                session.send_meta({channel.META_OVERLAP_FIRST_STEP: True})
            session.end_step(session.new_step_row(), none_t, none_o)  # init
            for step in range(script.steps):
                if self._interrupt_flag.is_set():
                    raise KeyboardInterrupt
                if step == script.killed_at:
                    self.code = -9
                    session.writer.close()  # dies without a word
                    os.close(config.control_fd)
                    return
                self.computing[0] += 1
                self.computing[1] = max(self.computing[1], self.computing[0])
                FakeRun.log.append(("step", label, step))
                time.sleep(script.step_time)
                if step == script.stall_at:
                    assert script.stall_until is not None
                    script.stall_until.wait()
                self.computing[0] -= 1
                if step == script.fail_at:
                    raise ValueError(f"boom in run {label}")
                row = session.new_step_row()
                row["params_fp"] = step + (1000 if script.differ_at is not None
                                           and step >= script.differ_at else 0)
                session.end_step(row, none_t, none_o)
                if self._interrupt_flag.is_set():
                    raise KeyboardInterrupt
        except StopRun:
            status = channel.STOPPED
        except KeyboardInterrupt:
            status, code = channel.INTERRUPTED, 130
        except ValueError as exc:
            status, code, error = channel.FAILED, 1, f"ValueError: {exc}"
        FakeRun.log.append(("end", label, session.step))
        session.finish(status, code, error)
        self.code = code
        if script.linger:
            self._interrupt_flag.wait()
        session.writer.close()
        os.close(config.control_fd)


def _bounded(fn: Callable[[], Any], bound: float = BOUND) -> Any:
    """Run ``fn`` in a thread; fail (instead of hanging) if it takes longer than ``bound``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"the schedule still waits after {bound} s"
    box["seconds"] = time.monotonic() - start
    if "error" in box:
        raise box["error"]
    return box["value"]


def _stop_when_a_row_is_missing(step: int, a: np.void | None, b: np.void | None) -> bool:
    return a is not None and b is not None  # as pipeline._LiveCompare


class Pair:
    """Makes the fake runs of one schedule and keeps them for inspection."""

    def __init__(self, tmp_path: Path, a: Script, b: Script) -> None:
        self.scripts = {"a": a, "b": b}
        self.tmp_path = tmp_path
        self.runs: dict[str, FakeRun] = {}
        self.computing = [0, 0]
        FakeRun.log = []

    def make_run(self, plan: Plan) -> Run:
        run = FakeRun(plan, self.scripts[plan.label], self.tmp_path, self.computing)
        self.runs[plan.label] = run
        return run

    def lockstep(self, **kwargs: Any) -> Lockstep:
        return Lockstep(self.make_run, stall_after=kwargs.pop("stall_after", 30.0),
                        poll=0.02, **kwargs)

    def sequential(self) -> Sequential:
        return Sequential(self.make_run)


PLANS = (Plan("a", []), Plan("b", []))


def test_lockstep_takes_turns_one_step_each(tmp_path: Path) -> None:
    # steps longer than a turn (turns.TURN_SECONDS): one step per turn
    pair = Pair(tmp_path, Script(steps=5, step_time=0.06), Script(steps=5, step_time=0.06))
    ra, rb = _bounded(lambda: pair.lockstep().run_pair(PLANS))
    assert (ra.status, ra.steps, rb.status, rb.steps) == ("complete", 5, "complete", 5)
    steps = [(label, step) for event, label, step in FakeRun.log if event == "step"]
    assert steps == [(label, k) for k in range(5) for label in "ab"]
    assert pair.computing[1] == 1  # never both at once


@pytest.mark.parametrize("schedule", ["lockstep", "sequential"])
def test_a_run_that_fails_in_one_run_only_is_named_and_nothing_waits(
        tmp_path: Path, schedule: str) -> None:
    pair = Pair(tmp_path, Script(steps=4), Script(steps=4, fail_at=1))
    sched = pair.lockstep() if schedule == "lockstep" else pair.sequential()
    with pytest.raises(ScriptFailed, match=r"failed in run b \(exit code 1\): ValueError: boom"):
        _bounded(lambda: sched.run_pair(PLANS, _stop_when_a_row_is_missing,
                                        on_hold=lambda a, b: None))
    assert not any(run.running() for run in pair.runs.values())


@pytest.mark.parametrize("early", ["a", "b"])
@pytest.mark.parametrize("hold", [True, False], ids=["hold", "no-hold"])
def test_a_run_that_ends_early_gives_both_results(tmp_path: Path, early: str,
                                                  hold: bool) -> None:
    """The run that finished waits in Session.finish (it kept outputs): it must be let go."""
    scripts = {label: Script(steps=2 if label == early else 5) for label in "ab"}
    pair = Pair(tmp_path, scripts["a"], scripts["b"])
    held: list[bool] = []
    results = _bounded(lambda: pair.lockstep().run_pair(
        PLANS, _stop_when_a_row_is_missing,
        on_hold=(lambda a, b: held.append(True)) if hold else None))
    by_label = {r.label: r for r in results}
    assert by_label[early].status == "complete" and by_label[early].steps == 2
    other = by_label["b" if early == "a" else "a"]
    # told to stop at the missing row; running freely, it may reach its end first
    assert other.complete and other.steps > 2
    assert not held  # nothing to hold: one run had ended
    assert not any(run.running() for run in pair.runs.values())


def test_a_killed_run_is_reported_and_the_other_is_stopped(tmp_path: Path) -> None:
    pair = Pair(tmp_path, Script(steps=6, killed_at=2), Script(steps=6))
    with pytest.raises(ScriptFailed, match=r"run a \(killed by signal 9\)"):
        _bounded(lambda: pair.lockstep().run_pair(PLANS, _stop_when_a_row_is_missing,
                                                  on_hold=lambda a, b: None))
    assert pair.runs["b"].end is not None and pair.runs["b"].end.status == "stopped"


def test_a_run_that_stalls_while_the_other_waits_frees_both(tmp_path: Path) -> None:
    """Run b needs something run a holds while it waits for its turn (a lock, a port):
    lockstep would deadlock; after the stall bound both run freely."""
    a_done = threading.Event()
    pair = Pair(tmp_path, Script(steps=3), Script(steps=3, stall_at=1, stall_until=a_done))
    original_finish = Session.finish

    def finish(session: Session, status: str, exit_code: int, error: str = "") -> None:
        if session.config.label == "a":
            a_done.set()
        original_finish(session, status, exit_code, error)

    schedule = pair.lockstep(stall_after=0.5, stall_factor=2.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Session, "finish", finish)
        ra, rb = _bounded(lambda: schedule.run_pair(PLANS))
    assert (ra.status, ra.steps, rb.status, rb.steps) == ("complete", 3, "complete", 3)


def test_hold_keeps_both_runs_alive_until_released(tmp_path: Path) -> None:
    # steps longer than a turn: one step per turn, so both are held at step 2 exactly
    # (short steps: tests/test_turns_grants.py)
    pair = Pair(tmp_path, Script(steps=8, differ_at=2, step_time=0.06),
                Script(steps=8, step_time=0.06))
    seen: dict[str, Any] = {}

    def judge(step: int, a: np.void | None, b: np.void | None) -> bool:
        return a is not None and b is not None and int(a["params_fp"]) == int(b["params_fp"])

    def on_hold(a: Run, b: Run) -> None:
        seen["alive"] = [not run.ended for run in (a, b)]
        seen["kept"] = [run.request_kept(2, 7, timeout=10) for run in (a, b)]

    ra, rb = _bounded(lambda: pair.lockstep().run_pair(PLANS, judge, on_hold))
    assert seen["alive"] == [True, True]
    assert [k[0].tolist() for k in seen["kept"]] == [[2.0, 3.0, 4.0, 5.0]] * 2
    assert (ra.status, ra.steps, rb.status, rb.steps) == ("stopped", 3, "stopped", 3)


def test_a_failing_hold_callback_still_ends_both_runs(tmp_path: Path) -> None:
    pair = Pair(tmp_path, Script(steps=8, differ_at=1), Script(steps=8))

    def on_hold(a: Run, b: Run) -> None:
        raise KeyboardInterrupt  # Ctrl-C while asking for kept outputs

    def judge(step: int, a: np.void | None, b: np.void | None) -> bool:
        return step < 1

    with pytest.raises(KeyboardInterrupt):
        _bounded(lambda: pair.lockstep().run_pair(PLANS, judge, on_hold))
    assert not any(run.running() for run in pair.runs.values())
    assert {run.interrupt().status for run in pair.runs.values()} <= {"stopped", "interrupted"}


def test_an_interrupted_run_raises_keyboard_interrupt(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # nondet itself got SIGINT (another test may have left errors.watch_sigint's state set)
    monkeypatch.setitem(errors._sigint, "seen", True)
    pair = Pair(tmp_path, Script(steps=20, step_time=0.05), Script(steps=20, step_time=0.05))
    schedule = pair.lockstep()
    timer = threading.Timer(0.5, lambda: pair.runs["a"]._interrupt_flag.set())
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        _bounded(lambda: schedule.run_pair(PLANS, _stop_when_a_row_is_missing))
    timer.cancel()
    assert not any(run.running() for run in pair.runs.values())


def test_a_run_that_does_not_exit_after_its_end_is_ended_after_a_grace(
        tmp_path: Path) -> None:
    """A run that said how it ended but whose process does not exit (a hung atexit
    handler, a non-daemon thread) is ended by signal after the grace period."""
    pair = Pair(tmp_path, Script(steps=3, linger=True), Script(steps=3))
    ra, rb = _bounded(lambda: pair.lockstep(exit_grace=0.5).run_pair(PLANS))
    assert (ra.status, ra.steps, rb.status) == ("complete", 3, "complete")
    assert pair.runs["a"]._interrupted and not pair.runs["b"]._interrupted


@pytest.mark.parametrize("schedule", ["lockstep", "sequential"])
def test_never_stop_runs_both_to_the_end(tmp_path: Path, schedule: str) -> None:
    pair = Pair(tmp_path, Script(steps=3), Script(steps=3))
    sched = pair.lockstep() if schedule == "lockstep" else pair.sequential()
    ra, rb = _bounded(lambda: sched.run_pair(PLANS, never_stop))
    assert [ra.steps, rb.steps] == [3, 3]
    if schedule == "sequential":
        assert [e for e in FakeRun.log if e[0] == "end"] == [("end", "a", 3), ("end", "b", 3)]


class _Recorder:
    """A run reduced to the control words it is sent (for Turns without threads)."""

    def __init__(self, label: str) -> None:
        self.plan = Plan(label, [])
        self.words: list[bytes] = []
        self.on_step: Any = None
        self.on_end: Any = None

    def send_control(self, message: bytes) -> None:
        self.words.append(message)

    def request_stop(self) -> None:
        if channel.STOP not in self.words:
            self.words.append(channel.STOP)


def _row(step: int, fp: int = 0) -> np.void:
    from nondet.records import STEP_DTYPE

    row = np.zeros(1, dtype=STEP_DTYPE)
    row["step"], row["params_fp"] = step, fp
    return row[0]


def test_turns_a_stop_reaches_a_run_that_already_ended() -> None:
    """The hang of issue 12: run b fails, the judge stops at the step it is missing; run b
    may be waiting in Session.finish and must be told too."""
    from nondet.turns import Turns

    a, b = _Recorder("a"), _Recorder("b")
    turns = Turns(a, b, _stop_when_a_row_is_missing, hold=True)  # type: ignore[arg-type]
    turns.on_row(a, _row(-1))
    turns.on_row(b, _row(-1))
    assert a.words == [channel.GO] and b.words == []
    turns.on_row(a, _row(0))
    assert b.words == [channel.GO]
    turns.on_end(b)  # failed during step 0
    assert channel.STOP in a.words and channel.STOP in b.words
    assert turns.done.is_set() is False  # a has not ended yet
    turns.on_end(a)
    assert turns.done.is_set() and not turns.holding


def test_turns_hold_then_release_stops_both() -> None:
    from nondet.turns import Turns

    a, b = _Recorder("a"), _Recorder("b")
    turns = Turns(a, b, lambda step, ra, rb: step < 1, hold=True)  # type: ignore[arg-type]
    for step in (-1, 0, 1):
        turns.on_row(a, _row(step))
        turns.on_row(b, _row(step))
    assert turns.done.is_set() and turns.holding
    # a went first with steps 0 and 1, b caught up; after step 1 nobody goes on
    assert a.words == [channel.GO, channel.GO] and b.words == [channel.GO, channel.GO]
    turns.release()
    assert a.words[-1] == channel.STOP and b.words[-1] == channel.STOP


def test_turns_stall_frees_both_once() -> None:
    from nondet.turns import Turns

    now = [0.0]
    a, b = _Recorder("a"), _Recorder("b")
    turns = Turns(a, b, never_stop, clock=lambda: now[0])  # type: ignore[arg-type]
    turns.on_row(a, _row(-1))  # a waits for b, which is still starting
    now[0] = 59.0
    assert not turns.stalled(now[0], stall_after=60, factor=5)
    now[0] = 61.0
    assert turns.stalled(now[0], stall_after=60, factor=5)
    turns.free_all()
    assert a.words[-1] == channel.FREE and b.words[-1] == channel.FREE
    assert not turns.stalled(1e9, stall_after=60, factor=5)


def test_turns_both_runs_compute_the_first_step_when_both_ask() -> None:
    """TensorFlow traces its step function in step 0 (single-threaded Python): when both
    runs say so, both get their word after init at once; turns resume from step 1."""
    from nondet.turns import Turns

    a, b = _Recorder("a"), _Recorder("b")
    a.overlap_first_step = b.overlap_first_step = True  # type: ignore[attr-defined]
    turns = Turns(a, b, never_stop)  # type: ignore[arg-type]
    turns.on_row(a, _row(-1))
    turns.on_row(b, _row(-1))
    assert a.words == [channel.GO] and b.words == [channel.GO]
    turns.on_row(b, _row(0))  # b finished step 0 first: it waits for a
    assert b.words == [channel.GO]
    turns.on_row(a, _row(0))  # both have step 0: a goes first with step 1, as before
    assert a.words == [channel.GO, channel.GO] and b.words == [channel.GO]
    turns.on_row(a, _row(1))
    assert b.words == [channel.GO, channel.GO]


def test_turns_take_turns_at_the_first_step_unless_both_ask() -> None:
    from nondet.turns import Turns

    a, b = _Recorder("a"), _Recorder("b")
    a.overlap_first_step = True  # type: ignore[attr-defined]
    turns = Turns(a, b, never_stop)  # type: ignore[arg-type]
    turns.on_row(a, _row(-1))
    turns.on_row(b, _row(-1))
    assert a.words == [channel.GO] and b.words == []


def test_lockstep_runs_a_first_step_both_runs_ask_for_at_once(tmp_path: Path) -> None:
    """The request travels as a META frame before the init row (channel), is mirrored by
    the parent's stream, and only step 0 is computed by both runs at once."""
    scripts = (Script(steps=4, step_time=0.3, overlap_first_step=True),
               Script(steps=4, step_time=0.3, overlap_first_step=True))
    pair = Pair(tmp_path, *scripts)
    ra, rb = _bounded(lambda: pair.lockstep().run_pair(PLANS))
    assert (ra.status, ra.steps, rb.status, rb.steps) == ("complete", 4, "complete", 4)
    assert pair.runs["a"].overlap_first_step and pair.runs["b"].overlap_first_step
    assert pair.computing[1] == 2  # step 0 in both at once
    steps = [(label, step) for event, label, step in FakeRun.log if event == "step"]
    assert sorted(steps[:2]) == [("a", 0), ("b", 0)]
    assert steps[2:] == [(label, k) for k in range(1, 4) for label in "ab"]


def test_the_exception_line_of_a_message_of_several_lines_is_its_first() -> None:
    """Trials: Keras's "Exception encountered when calling ..." message was summed up by
    its last line (``• kwargs=<class 'inspect._empty'>``), TensorFlow's DataLossError by
    its node context (``[[{{node IteratorGetNext}}]]``)."""
    keras = ("Traceback (most recent call last):\n"
             '  File "/t/train.py", line 9, in <module>\n'
             "    model(x)\n"
             '  File "/k/layer.py", line 3, in call\n'
             "    raise ValueError(...)\n"
             "ValueError: Exception encountered when calling Dense.call().\n"
             "\n"
             "Input 0 has the wrong rank\n"
             "\n"
             "Arguments received by Dense.call():\n"
             "  • kwargs=<class 'inspect._empty'>\n")
    assert schedule.exception_line(keras) == (
        "ValueError: Exception encountered when calling Dense.call().")
    tf = ("Traceback (most recent call last):\n"
          '  File "/t/train.py", line 20, in <module>\n'
          "    model.fit(ds)\n"
          "    ~~~~~~~~~^^^^\n"
          "tensorflow.python.framework.errors_impl.DataLossError: corrupted record at 4040\n"
          "\t [[{{node IteratorGetNext}}]] [Op:__inference_multi_step_on_iterator_2138]\n")
    assert schedule.exception_line(tf).endswith("DataLossError: corrupted record at 4040")
    assert schedule.exception_line("no traceback here\nlast words\n") == "last words"
