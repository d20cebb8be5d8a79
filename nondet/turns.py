"""The turn-taking of two lockstep runs (``schedule.Lockstep``), driven by their callbacks.

Each run waits after each step for a control word (``channel.GO``, ``FREE``, ``STOP``);
``Turns`` decides which run goes next from the rows the runs sent, shows the judge each
step once both rows are in, and holds or stops both when the judge says so. It never
waits itself: the schedule's main thread polls ``done``, ``stalled`` and ``makes_wait``
(see the ``schedule`` docstring: nothing a run does leaves nondet waiting).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from nondet import channel
from nondet.records import INIT_STEP

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


class Turns:
    """The turn-taking of two lockstep runs, driven by their callbacks (pump threads).

    A run waits after each step until told GO (run one more step), FREE (stop waiting:
    the other run has ended) or STOP. ``judge(step, row_a, row_b)`` sees each step once
    both rows are in, or one row and the other run has ended (its row is None).
    ``done`` is set when the runs are held or have both ended.
    """

    def __init__(self, a: Player, b: Player, judge: Judge, hold: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runs = (a, b)
        self.judge = judge
        self.hold = hold
        self.done = threading.Event()
        self.holding = False
        self._lock = threading.RLock()
        self._rows: dict[Player, dict[int, np.void]] = {a: {}, b: {}}
        self._waiting: dict[Player, int | None] = {a: None, b: None}
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
            if run not in self._ended and not self._free:
                self._waiting[run] = step
            self._advance()

    def on_end(self, run: Player) -> None:
        with self._lock:
            if run in self._ended:
                return  # replayed already
            self._last_activity = self._clock()
            self._ended.add(run)
            self._waiting[run] = None
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
            return someone_waits and now - self._last_activity > limit

    def makes_wait(self, run: Player) -> bool:
        """Is ``run`` waiting for nondet's word (its turn, a hold)? Then it is not idle."""
        with self._lock:
            return self.holding or (self._waiting[run] is not None and not self._free)

    def free_all(self) -> None:
        """Give up turn-taking: every run goes on on its own, nothing is held."""
        with self._lock:
            self._free = True
            self.hold = False
            for run in self.runs:
                self._waiting[run] = None
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
            self._go(a)
            self._go(b)
            return
        if ka == kb:
            self._go(a)  # both finished step k: A goes first with k + 1
        elif ka > kb:
            self._go(b)  # A is a step ahead: B catches up

    def _go(self, run: Player) -> None:
        self._waiting[run] = None
        run.send_control(channel.GO)

    def _judge_complete_steps(self) -> None:
        a, b = self.runs
        rows_a, rows_b = self._rows[a], self._rows[b]
        for step in sorted(set(rows_a) | set(rows_b)):
            if step in self._judged:
                continue
            have_both = step in rows_a and step in rows_b
            other_ended = (step in rows_a and b in self._ended) or (
                step in rows_b and a in self._ended)
            if not (have_both or other_ended):
                continue
            self._judged.add(step)
            if self._stopping or self.judge(step, rows_a.get(step), rows_b.get(step)):
                continue
            if self.hold and not self._ended and not self._free:
                self.holding = True  # both are waiting at this step: keep them there
                self._stopping = True
                self.done.set()
                return
            self.stop_all()

    def stop_all(self) -> None:
        # Every run, the ended ones too: a finished run may be waiting in Session.finish.
        self._stopping = True
        for run in self.runs:
            run.request_stop()
