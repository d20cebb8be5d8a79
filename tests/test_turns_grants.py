"""Lockstep turns of several steps (turns.Grants): short steps are granted together.

Unit tests drive ``Turns`` with recorders (the control words a run is sent) and rows whose
``wall`` says how long each step took; the others run the real child side (``Session``
in a thread, real pipes: tests/test_schedule.py's ``FakeRun``) under a time bound.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nondet import analysis, channel, compare
from nondet.errors import ScriptFailed
from nondet.frameworks.base import StopRun
from nondet.launch import Plan
from nondet.records import OP_DTYPE, STEP_DTYPE, TENSOR_DTYPE
from nondet.schedule import Run, never_stop
from nondet.session import ChildConfig, Session
from nondet.store import open_capture
from nondet.turns import MAX_GRANT, Turns
from tests.test_schedule import Pair, Script, _bounded, _Recorder

MS = 0.001


def _row(step: int, wall: float, fp: int = 0) -> np.void:
    row = np.zeros(1, dtype=STEP_DTYPE)
    row["step"], row["wall"], row["params_fp"] = step, wall, fp
    out: np.void = row[0]
    return out


class _Judge:
    """Records every step it is shown; stops at the first differing one (and holds there
    with ``hold``, as the pipeline's live judge after its growth steps)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.first_difference: int | None = None

    def __call__(self, step: int, a: np.void | None, b: np.void | None) -> bool:
        self.seen.append(step)
        if a is None or b is None:
            return False
        if int(a["params_fp"]) != int(b["params_fp"]):
            self.first_difference = step
            return False
        return True


def _feed(turns: Turns, run: _Recorder, steps: range, step_seconds: float,
          differ_at: int | None = None) -> None:
    for step in steps:
        fp = 1000 if differ_at is not None and step >= differ_at else 0
        turns.on_row(run, _row(step, (step + 2) * step_seconds, fp))


def _start(step_seconds: float, judge: Any = never_stop, hold: bool = False,
           a_plan: Plan | None = None) -> tuple[Turns, _Recorder, _Recorder]:
    """Both runs through init, step 0 and step 1 (both measured) taking turns one by one."""
    a, b = _Recorder("a"), _Recorder("b")
    if a_plan is not None:
        a.plan = a_plan
    turns = Turns(a, b, judge, hold=hold)
    for step in (-1, 0, 1):
        _feed(turns, a, range(step, step + 1), step_seconds)
        _feed(turns, b, range(step, step + 1), step_seconds)
    assert a.words[:2] == [channel.GO] * 2 and b.words == [channel.GO] * 2  # not measured
    return turns, a, b


def test_short_steps_are_granted_together_and_the_judge_sees_each_once() -> None:
    judge = _Judge()
    turns, a, b = _start(1 * MS, judge)
    assert a.words[-1] == b"go %d\n" % MAX_GRANT  # 1 ms steps: 50 ms a turn, at most 32
    _feed(turns, a, range(2, 1 + MAX_GRANT), 1 * MS)
    assert b.words == [channel.GO] * 2  # a is inside its grant: b is not told anything
    _feed(turns, a, range(1 + MAX_GRANT, 2 + MAX_GRANT), 1 * MS)
    assert b.words[-1] == b"go %d\n" % MAX_GRANT  # b catches up in one turn
    _feed(turns, b, range(2, 2 + MAX_GRANT), 1 * MS)
    assert judge.seen == list(range(-1, 2 + MAX_GRANT))  # every step, in order, once
    assert a.words[-1] == b"go %d\n" % MAX_GRANT and len(a.words) == 4


def test_long_steps_keep_one_step_per_turn() -> None:
    turns, a, b = _start(60 * MS)
    assert a.words[-1] == channel.GO
    _feed(turns, a, range(2, 3), 60 * MS)
    assert b.words[-1] == channel.GO and len(b.words) == 3


def test_steps_of_12_ms_are_granted_four_at_a_time() -> None:
    _, a, _ = _start(12 * MS)
    assert a.words[-1] == b"go 4\n"  # a turn of 50 ms


def test_a_grant_ends_at_an_op_captured_step_and_those_go_one_by_one() -> None:
    turns, a, b = _start(1 * MS, a_plan=Plan("a", [10, 11]))
    assert a.words[-1] == b"go 9\n"  # steps 2..10: it waits after step 10, as before
    _feed(turns, a, range(2, 11), 1 * MS)
    _feed(turns, b, range(2, 11), 1 * MS)
    assert a.words[-1] == channel.GO  # step 11 alone
    _feed(turns, a, range(11, 12), 1 * MS)
    _feed(turns, b, range(11, 12), 1 * MS)
    assert a.words[-1] == b"go %d\n" % MAX_GRANT  # after the window: grants again


def test_every_step_op_captured_keeps_one_step_per_turn() -> None:
    _, a, _ = _start(1 * MS, a_plan=Plan("a", None))
    assert a.words[-1] == channel.GO


def test_a_difference_inside_a_grant_is_found_at_its_step_and_both_overshoot_alike() -> None:
    judge = _Judge()
    turns, a, b = _start(1 * MS, judge, hold=True)
    _feed(turns, a, range(2, 2 + MAX_GRANT), 1 * MS, differ_at=9)
    _feed(turns, b, range(2, 12), 1 * MS)  # b catches up: the judge parts at step 9
    assert judge.first_difference == 9 and judge.seen[-1] == 9
    assert turns.done.is_set() and turns.holding
    _feed(turns, b, range(12, 2 + MAX_GRANT), 1 * MS)  # the rest of b's grant
    assert judge.seen[-1] == 9  # steps after the stop are never judged
    turns.release()
    assert a.words[-1] == channel.STOP and b.words[-1] == channel.STOP
    assert b.words[-2] == b"go %d\n" % MAX_GRANT  # never told to go further than a


def test_a_run_that_ends_inside_its_grant_frees_the_other_at_once() -> None:
    judge = _Judge()
    turns, a, b = _start(1 * MS, judge)
    _feed(turns, a, range(2, 6), 1 * MS)  # then it crashes inside its grant
    turns.on_end(a)
    assert b.words[-1] == channel.FREE  # b waited at step 1: it goes on alone
    _feed(turns, b, range(2, 7), 1 * MS)
    assert judge.seen == list(range(-1, 7))  # steps 2-5 against a's rows, 6 alone: stop
    assert a.words[-1] == channel.STOP and b.words[-1] == channel.STOP
    turns.on_end(b)
    assert turns.done.is_set() and not turns.holding


def test_a_run_catching_up_is_freed_at_the_end_of_its_grant_when_the_other_ended() -> None:
    turns, a, b = _start(1 * MS)
    _feed(turns, a, range(2, 2 + MAX_GRANT), 1 * MS)
    _feed(turns, b, range(2, 5), 1 * MS)
    turns.on_end(a)  # killed while it waited: b is inside its grant and reads no word
    assert b.words[-1] == b"go %d\n" % MAX_GRANT
    assert turns.makes_wait(b) is False
    _feed(turns, b, range(5, 2 + MAX_GRANT), 1 * MS)
    assert b.words[-1] == channel.FREE  # it waits at the end of its grant: freed there


# -- the child side --------------------------------------------------------------------------
def _session(tmp_path: Path) -> tuple[Session, int, int]:
    data_r, data_w = os.pipe()
    ctrl_r, ctrl_w = os.pipe()
    os.set_blocking(data_r, False)
    config = ChildConfig(label="a", seed=0, channel_fd=data_w, control_fd=ctrl_r,
                         lockstep=True)
    return Session(config), data_r, ctrl_w


def _end_step(session: Session) -> None:
    session.end_step(session.new_step_row(), np.zeros(0, TENSOR_DTYPE), np.zeros(0, OP_DTYPE))


def _rows_sent(fd: int, parser: channel.FrameParser) -> list[int]:
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return []
    return [int(np.frombuffer(p, STEP_DTYPE)["step"][0])
            for kind, p in parser.feed(data) if kind == channel.STEP]


def test_a_granted_run_waits_only_after_its_steps_and_reads_a_stop_there(
        tmp_path: Path) -> None:
    session, data_r, ctrl_w = _session(tmp_path)
    parser = channel.FrameParser()
    os.write(ctrl_w, channel.go(3))
    _end_step(session)  # init: waits, and is granted steps 0, 1, 2
    assert _rows_sent(data_r, parser) == [-1]
    os.write(ctrl_w, channel.STOP)  # the stop arrives inside the grant
    _end_step(session)  # step 0
    _end_step(session)  # step 1: inside the grant, its rows are held back (one write)
    assert _rows_sent(data_r, parser) == []
    with pytest.raises(StopRun):
        _end_step(session)  # step 2 ends the grant: the rows go out, then the stop is read
    assert _rows_sent(data_r, parser) == [0, 1, 2]


def test_a_go_word_grants_its_count() -> None:
    assert channel.go(1) == channel.GO and channel.go(7) == b"go 7\n"
    r, w = os.pipe()
    os.write(w, channel.go(7))
    assert channel.wait_for_grant(r, lambda s, i: None) == (channel.GO, 7)
    os.write(w, channel.GO)
    assert channel.wait_for_grant(r, lambda s, i: None) == (channel.GO, 1)
    os.write(w, channel.go(7) + channel.STOP)
    assert channel.wait_for_grant(r, lambda s, i: None) == (channel.STOP, 0)


# -- whole schedules, short steps -------------------------------------------------------------
class _Counting(Pair):
    """Counts the GO words of each run (a grant of N steps is one word)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.words: dict[str, list[bytes]] = {"a": [], "b": []}

    def make_run(self, plan: Plan) -> Run:
        run = super().make_run(plan)
        send = run.send_control

        def counted(message: bytes, label: str = plan.label) -> None:
            self.words[label].append(message)
            send(message)

        run.send_control = counted  # type: ignore[method-assign]
        return run

    def grants(self) -> int:
        return sum(w.startswith(b"go ") for words in self.words.values() for w in words)


PLANS = (Plan("a", []), Plan("b", []))


def test_a_deterministic_pair_of_short_steps_stays_quiet_in_few_turns(tmp_path: Path) -> None:
    pair = _Counting(tmp_path, Script(steps=150, step_time=MS), Script(steps=150, step_time=MS))
    judge = _Judge()
    ra, rb = _bounded(lambda: pair.lockstep().run_pair(PLANS, judge))
    assert (ra.status, ra.steps, rb.status, rb.steps) == ("complete", 150, "complete", 150)
    assert judge.first_difference is None and judge.seen == list(range(-1, 150))
    assert pair.grants() > 0 and len(pair.words["a"]) < 50  # far fewer turns than steps
    capture_a, capture_b = open_capture(ra.path), open_capture(rb.path)
    assert compare.first_step_divergence(capture_a.steps, capture_b.steps) is None


def test_a_difference_among_short_steps_is_found_exactly_and_held(tmp_path: Path) -> None:
    pair = _Counting(tmp_path, Script(steps=300, step_time=MS, differ_at=40),
                     Script(steps=300, step_time=MS))
    judge = _Judge()
    seen: dict[str, Any] = {}

    def on_hold(a: Run, b: Run) -> None:
        seen["kept"] = [run.request_kept(40, 3, timeout=10) for run in (a, b)]

    ra, rb = _bounded(lambda: pair.lockstep().run_pair(PLANS, judge, on_hold))
    assert judge.first_difference == 40 and judge.seen == list(range(-1, 41))
    assert [k[0].tolist() for k in seen["kept"]] == [[40.0, 41.0, 42.0, 43.0]] * 2
    assert pair.grants() > 0
    # both overshoot the stop alike, by less than a grant: same steps, both stopped
    assert (ra.status, rb.status) == ("stopped", "stopped") and ra.steps == rb.steps
    assert 41 <= ra.steps <= 41 + MAX_GRANT - 1
    capture_a, capture_b = open_capture(ra.path), open_capture(rb.path)
    extra = analysis._extra_steps_count(capture_a, capture_b)
    found = compare.first_step_divergence(capture_a.steps, capture_b.steps, extra)
    assert found is not None and found.step == 40 and not found.structural


def test_a_run_killed_inside_a_grant_ends_both_and_nothing_waits(tmp_path: Path) -> None:
    pair = _Counting(tmp_path, Script(steps=300, step_time=MS),
                     Script(steps=300, step_time=MS, killed_at=100))
    start = time.monotonic()
    with pytest.raises(ScriptFailed, match=r"failed in run b \(killed by signal 9\)"):
        _bounded(lambda: pair.lockstep().run_pair(PLANS, _Judge()))
    assert time.monotonic() - start < 10
    assert pair.grants() > 0  # the kill came during a grant of several steps
    assert [w for w in pair.words["b"] if w.startswith(b"go ")]


def test_after_a_differing_step_turns_are_one_step_again() -> None:
    """The judge stops a few growth steps after the first difference: no new grant may
    carry the runs further past that stop than what was granted before it."""
    turns, a, b = _start(1 * MS)
    _feed(turns, a, range(2, 2 + MAX_GRANT), 1 * MS, differ_at=20)
    _feed(turns, b, range(2, 2 + MAX_GRANT), 1 * MS)
    assert a.words[-1] == channel.GO  # never_stop goes on, one step a turn


def test_rows_held_back_in_a_grant_are_written_when_the_script_goes_quiet() -> None:
    """A script that sleeps or serves after its last step inside a grant: the parent must
    still get that step (tests/test_idle.py ends such a run as idle and compares it)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    writer = channel.FrameWriter(w)
    writer.send(channel.STEP, b"row of step 3")
    writer.flush_later(0.1)
    with pytest.raises(BlockingIOError):
        os.read(r, 100)  # held back for now
    deadline = time.monotonic() + 5
    data = b""
    while not data and time.monotonic() < deadline:
        time.sleep(0.02)
        try:
            data = os.read(r, 100)
        except BlockingIOError:
            pass
    assert channel.FrameParser().feed(data) == [(channel.STEP, b"row of step 3")]
    writer.close()


def test_after_a_stop_a_run_that_sends_a_row_is_not_kept_waiting() -> None:
    """Runs told to stop wait for nothing more: a run that sends a row after the judge
    stopped (and then sleeps forever) must be left to the idle check, not held as waiting
    (it hung tests/test_idle.py when a run ended inside its grant)."""
    turns, a, b = _start(1 * MS, _Judge())
    _feed(turns, a, range(2, 4), 1 * MS)
    turns.on_end(a)  # ended inside its grant after step 3
    _feed(turns, b, range(2, 5), 1 * MS)  # step 4: a row only b has: the judge stops
    assert channel.STOP in b.words
    assert not turns.makes_wait(b)
