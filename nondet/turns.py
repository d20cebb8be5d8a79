"""The turn-taking of two lockstep runs (``schedule.Lockstep``), driven by their callbacks.

Each run waits after each turn for a control word (``channel.GO``, ``FREE``, ``STOP``);
``Turns`` decides which run goes next from the rows the runs sent, shows the judge each
step once both rows are in, and holds or stops both when the judge says so. It never
waits itself: the schedule's main thread polls ``done``, ``stalled`` and ``makes_wait``
(see the ``schedule`` docstring: nothing a run does leaves nondet waiting).

A turn is one step, or several when steps are short (``Grants``): a word per step costs
a round trip through both processes (about 1.4 ms per run and step on this machine,
docs/benchmarks.md), more than a small model's whole step. A run granted N steps runs
them and waits after the last; the other then catches up to the same step in one turn.
The judge still sees every step, in order, once both rows are in, so the first differing
step is the same; a stop or hold reaches a run at the end of its grant, so both runs
overshoot a stop by the same at most N - 1 steps, which both captures then hold.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from nondet import channel, compare, paused
from nondet.records import INIT_STEP

#: A turn lasts at least this long when steps are short: a run is granted that many steps.
TURN_SECONDS = 0.05
#: Most steps granted at once: how far a run may overshoot a stop (by MAX_GRANT - 1 steps).
MAX_GRANT = 32
#: Step times are measured over this many latest steps of each run (their median counts:
#: on a loaded machine one step in a few is descheduled for milliseconds).
MEASURED_STEPS = 8

#: Sees each step once both runs have it (a row is None when that run has ended without
#: it); returns False to stop both runs.
Judge = Callable[[int, np.void | None, np.void | None], bool]


class Player(Protocol):
    """What turn-taking needs of a run (``schedule.Run`` has it). A run started early
    (nondet.live) may also have ``steps`` and ``ended`` already; a run whose first step is
    single-threaded work says ``overlap_first_step`` (both read with ``getattr``)."""

    on_step: Callable[[Any, np.void], None] | None
    on_end: Callable[[Any], None] | None

    def send_control(self, message: bytes) -> None: ...

    def request_stop(self) -> None: ...


class Grants:
    """How many steps a run may go at once: enough that a turn lasts ``turn_seconds``, by
    the median of the latest ``MEASURED_STEPS`` steps of the slower run (their rows'
    ``wall``, which leaves out the time a run was held), at most ``max_grant``. One step
    until both runs have measured steps, when steps are long, and once two rows have
    differed. A grant ends at the next step a run records op by op (a plan's
    ``op_steps``; None: every step, so one step a turn), and the op window's steps go one a
    turn: there a run waits after each step as before, where holds and dump requests
    expect it."""

    def __init__(self, runs: tuple[Player, Player], turn_seconds: float = TURN_SECONDS,
                 max_grant: int = MAX_GRANT) -> None:
        self.turn_seconds = turn_seconds
        self.max_grant = max_grant
        self._last: dict[Player, tuple[int, float]] = {}
        self._times: dict[Player, deque[float]] = {
            run: deque(maxlen=MEASURED_STEPS) for run in runs}
        # once two rows differ in training state the judge stops soon (a few growth steps):
        # one step a turn
        # from then on, so that the runs overshoot its stop by no more than already granted
        self.differed = False
        self._op_steps: list[int] | None = []
        for run in runs:
            plan = getattr(run, "plan", None)
            if plan is None:
                continue
            if plan.op_steps is None:
                self._op_steps = None  # op-level capture at every step: one step per turn
                break
            self._op_steps.extend(plan.op_steps)

    def measure(self, run: Player, row: np.void) -> None:
        step, wall = int(row["step"]), float(row["wall"])
        last = self._last.get(run)
        if last is not None and step == last[0] + 1:
            self._times[run].append(max(0.0, wall - last[1]))
        self._last[run] = (step, wall)

    def steps(self, after: int) -> int:
        """Steps to grant a run that has finished step ``after``."""
        if self.max_grant <= 1 or self._op_steps is None or self.differed:
            return 1
        if any(len(times) < 2 for times in self._times.values()):
            return 1  # not measured yet (step 0 includes the script's warm-up)
        slowest = max(statistics.median(times) for times in self._times.values())
        n = self.max_grant if slowest <= 0 else int(self.turn_seconds / slowest)
        n = max(1, min(n, self.max_grant))
        # an op-captured step ends a grant: the run waits after it, as with one step a turn
        ahead = [s for s in self._op_steps if s > after]
        return min(n, min(ahead) - after) if ahead else n


class Turns:
    """The turn-taking of two lockstep runs, driven by their callbacks (pump threads).

    A run waits after each turn until told GO (run one more step, or N: ``Grants``), FREE
    (stop waiting: the other run has ended) or STOP. ``judge(step, row_a, row_b)`` sees
    each step once both rows are in, or one row and the other run has ended (its row is None).
    ``done`` is set when the runs are held or have both ended.
    """

    def __init__(self, a: Player, b: Player, judge: Judge, hold: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 turn_seconds: float = TURN_SECONDS, max_grant: int = MAX_GRANT) -> None:
        self.runs = (a, b)
        self.judge = judge
        self.hold = hold
        self.done = threading.Event()
        self.holding = False
        self._lock = threading.RLock()
        self._rows: dict[Player, dict[int, np.void]] = {a: {}, b: {}}
        self._waiting: dict[Player, int | None] = {a: None, b: None}
        # the step after which a run granted several steps waits next (None: its next row)
        self._wait_at: dict[Player, int | None] = {a: None, b: None}
        self.grants = Grants(self.runs, turn_seconds, max_grant)
        self._unjudged: set[int] = set()  # steps with a row, not yet shown to the judge
        self._ended: set[Player] = set()
        self._judged: set[int] = set()
        self._stopping = False
        self._free = False  # turn-taking given up: both run freely
        self._clock = clock
        now = clock()
        self._last_row = {a: now, b: now}
        self._last_activity = now
        self._slowest = 0.0  # longest time between two rows of one run so far
        for run in self.runs:
            run.on_step = self.on_row
            run.on_end = self.on_end
        # A run started early (nondet.live) may have sent rows or ended already: replayed
        for run in self.runs:
            for row in list(getattr(run, "steps", ())):
                self.on_row(run, row)
            if getattr(run, "ended", False):
                self.on_end(run)

    # -- callbacks (pump threads) ------------------------------------------------------------
    def on_row(self, run: Player, row: np.void) -> None:
        with self._lock:
            if int(row["step"]) in self._rows[run]:
                return  # replayed already (a run never sends a step twice)
            now = self._clock()
            self._slowest = max(self._slowest, now - self._last_row[run])
            self._last_row[run] = self._last_activity = now
            step = int(row["step"])
            self._rows[run][step] = row
            if step not in self._judged:
                self._unjudged.add(step)
            self.grants.measure(run, row)
            wait_at = self._wait_at[run]
            if run not in self._ended and not self._free and (wait_at is None
                                                              or step >= wait_at):
                self._waiting[run] = step  # the end of its turn: it waits for a word now
                self._wait_at[run] = None
            self._advance()

    def on_end(self, run: Player) -> None:
        with self._lock:
            if run in self._ended:
                return  # replayed already
            self._last_activity = self._clock()
            self._ended.add(run)
            self._waiting[run] = self._wait_at[run] = None
            self._advance()
            if len(self._ended) == 2:
                # Finished runs that kept outputs wait in Session.finish: hold them there
                # for on_hold, unless they were already told to stop.
                self.holding = self.hold and not self._stopping and not self._free
                self.done.set()

    # -- the main thread ------------------------------------------------------------------------
    def stalled(self, now: float, stall_after: float, factor: float) -> bool:
        """Does a run wait for one that has sent nothing for too long?"""
        with self._lock:
            if self._free or self._stopping or self.holding:
                return False
            someone_waits = any(w is not None for w in self._waiting.values()) or (
                self.hold and len(self._ended) == 1)  # in Session.finish
            limit = max(stall_after, factor * self._slowest)
            # a pause of nondet itself (Ctrl-Z, a suspended job) is nobody's silence
            return someone_waits and now - paused.since(self._last_activity) > limit

    def makes_wait(self, run: Player) -> bool:
        """Is ``run`` waiting for nondet's word (its turn, a hold)? Then it is not idle."""
        with self._lock:
            # Once the runs are told to stop (not held), nothing keeps one waiting: a run
            # that then sleeps or serves forever is idle, not waiting for nondet's word.
            return self.holding or (self._waiting[run] is not None and not self._free
                                    and not self._stopping)

    def free_all(self) -> None:
        """Give up turn-taking: every run goes on on its own, nothing is held."""
        with self._lock:
            self._free = True
            self.hold = False
            for run in self.runs:
                self._waiting[run] = self._wait_at[run] = None
                run.send_control(channel.FREE)

    def release(self) -> None:
        """End a hold (or make sure nothing waits): every run is told to stop."""
        with self._lock:
            self.holding = False
            self._stopping = True
            for run in self.runs:
                run.request_stop()

    # -- turns ------------------------------------------------------------------------------------
    def _advance(self) -> None:
        a, b = self.runs
        self._judge_complete_steps()
        if self._stopping or self._free:
            return
        if self._ended:
            for run in self.runs:  # the other run has nobody to take turns with
                if self._waiting[run] is not None:
                    self._waiting[run] = None
                    run.send_control(channel.FREE)
            return
        ka, kb = self._waiting[a], self._waiting[b]
        if ka is None or kb is None:
            return  # one of them is still computing its step
        if ka == kb == INIT_STEP and all(getattr(r, "overlap_first_step", False)
                                         for r in self.runs):
            # Both said their first step is single-threaded work (TensorFlow traces its step
            # function: channel.META_OVERLAP_FIRST_STEP): both compute it, then turns resume
            self._go(a, 1)
            self._go(b, 1)
            return
        if ka == kb:
            self._go(a, self.grants.steps(ka))  # both finished step k: A goes first
        elif ka > kb:
            self._go(b, ka - kb)  # A is ahead: B catches up, in one turn
        else:
            self._go(a, kb - ka)  # (B ahead: only after both computed the first step)

    def _go(self, run: Player, steps: int) -> None:
        ran = self._waiting[run]
        self._waiting[run] = None
        self._wait_at[run] = None if steps <= 1 or ran is None else ran + steps
        run.send_control(channel.go(steps))

    def _judge_complete_steps(self) -> None:
        a, b = self.runs
        rows_a, rows_b = self._rows[a], self._rows[b]
        for step in sorted(self._unjudged):  # a few steps: those of the current turn
            have_both = step in rows_a and step in rows_b
            other_ended = (step in rows_a and b in self._ended) or (
                step in rows_b and a in self._ended)
            if not (have_both or other_ended):
                continue
            self._unjudged.discard(step)
            self._judged.add(step)
            if have_both and compare.training_differs(rows_a[step], rows_b[step]):
                self.grants.differed = True
            if self._stopping or self.judge(step, rows_a.get(step), rows_b.get(step)):
                continue
            if self.hold and not self._ended and not self._free:
                # both are waiting at this step, or a run catching up will wait at the end
                # of its grant (a dump request is answered there): keep them there
                self.holding = True
                self._stopping = True
                self.done.set()
                return
            self.stop_all()

    def stop_all(self) -> None:
        # Every run, the ended ones too: a finished run may be waiting in Session.finish.
        self._stopping = True
        for run in self.runs:
            run.request_stop()
