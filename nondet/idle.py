"""A run that has gone idle: it sends nothing and its processes use no CPU.

A script may train and then not end: it sleeps, serves something, waits for a thread that
never finishes. ``python train.py`` would then wait forever too, but nondet is not to hang
(each wait has a timeout), and the steps it has recorded are all there is to compare.
A run is idle when, for ``after`` seconds, it has sent no frame and its process tree
(the script and every process it started: DataLoader workers compute while the main
process waits) has used less than ``BUSY_FRACTION`` of one core. A script that computes
(a long evaluation, a checkpoint written), or that nondet itself keeps waiting (lockstep
turns: the schedule never asks then), is never idle.

CPU time is read from ``/proc``; where there is none, no run is ever called idle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from nondet import paused, procstat, settings

#: Seconds without a frame and without CPU use before a run counts as idle
#: (``NONDET_IDLE_AFTER`` overrides it: a shorter value for tests, a longer for scripts
#: that legitimately wait, e.g. for a slow network file system).
IDLE_AFTER = settings.DURATIONS["NONDET_IDLE_AFTER"]
#: Below this fraction of one core over the window, a process tree is not computing.
BUSY_FRACTION = 0.02

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def idle_after() -> float:
    """The idle limit in seconds (``NONDET_IDLE_AFTER``, else ``IDLE_AFTER``)."""
    return settings.seconds("NONDET_IDLE_AFTER")


def _tree(pid: int) -> list[tuple[float, str]] | None:
    """(CPU seconds, state letter) of ``pid`` and each living descendant, or None when
    ``/proc`` cannot tell (not Linux, or the process is gone)."""
    stats = procstat.stat_fields()
    if stats is None:
        return None
    parents: dict[int, int] = {}
    rows: dict[int, tuple[float, str]] = {}
    for entry, fields in stats.items():
        try:
            parents[entry] = int(fields[1])
            rows[entry] = (int(fields[11]) + int(fields[12])) / _TICKS, fields[0]
        except (IndexError, ValueError):
            continue
    if pid not in rows:
        return None
    tree, frontier = [], [pid]
    seen: set[int] = set()
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in rows:
            tree.append(rows[current])
        frontier.extend(child for child, parent in parents.items() if parent == current)
    return tree


def tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and all its living descendants, or None when
    ``/proc`` cannot tell (not Linux, or the process is gone)."""
    tree = _tree(pid)
    return None if tree is None else sum(cpu for cpu, _ in tree)


def tree_runnable(pid: int) -> bool:
    """Some process of the tree is running or waiting for a CPU (state R): on a machine
    loaded enough it may get under ``BUSY_FRACTION`` of a core, yet it is not idle."""
    return any(state == "R" for _, state in _tree(pid) or [])


class IdleWatch:
    """Whether one run has been idle for ``after`` seconds (module docstring).

    ``activity()`` is called for every frame the run sends; ``idle()`` samples its CPU
    time at most every ``sample`` seconds."""

    def __init__(self, pid: int, after: float,
                 cpu: Callable[[int], float | None] = tree_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 runnable: Callable[[int], bool] = tree_runnable) -> None:
        self.pid = pid
        self.after = after
        self._cpu = cpu
        self._runnable = runnable
        self._clock = clock
        self._sample = min(5.0, after / 4)
        now = clock()
        self._since = now  # start of the current quiet window
        self._cpu_since: float | None = None  # CPU time at its start
        self._last_sample = now - self._sample
        #: when the run last sent a frame (its start until the first), and the longest
        #: time it went between two frames so far: how long this script goes quietly
        #: (``outlived``).
        self.last_frame = now
        self.longest_quiet = 0.0
        self._word_at = now
        self._created = now
        #: seconds from the run's start to its first step row (None: none yet)
        self.startup: float | None = None

    def activity(self, counts: bool = True) -> None:
        """A frame arrived. ``counts``: the quiet spell it ends counts towards
        ``longest_quiet``; the run's start-up until its first step row does not (imports,
        model set-up: on a loaded machine much the longest, and it says nothing of what
        a run does once it has sent its last step)."""
        now = self._clock()
        if counts:  # from its last frame, or from nondet's word if it waited for one
            spell = now - max(self.last_frame, self._word_at)
            self.longest_quiet = max(self.longest_quiet, spell)
        self._since = self.last_frame = now
        self._cpu_since = None

    def word(self) -> None:
        """nondet sent the run a word (its turn, go on freely, stop): the time it waited for
        it was nondet's, not a quiet spell of the script's (a lockstep run held while its
        twin was stuck would otherwise make that twin wait 5 x as long to be ended)."""
        self._word_at = self._clock()

    def stepped(self) -> None:
        """The run has sent its first step row (called with every later one too)."""
        if self.startup is None:
            self.startup = self._clock() - self._created

    def outlived(self, twin: IdleWatch, floor: float, factor: float = 5.0) -> float:
        """Seconds this run has gone without a frame since both its last one and its
        twin's end (``twin``: the watch of the other run of the pair, which has ended), if
        that is longer than ``factor`` x the twin's longest quiet spell once it had started (a
        step, the time from its last step to its end) and than ``floor``; else 0.

        The twin ran the same script and ended: a run that goes quiet for several times
        longer than the twin ever did, computing or not, is not doing what the twin did (a
        loop that never ends in one run only) and would keep nondet waiting forever."""
        now = self._clock()
        quiet = now - paused.since(max(self.last_frame, twin.last_frame))
        spell = twin.longest_quiet
        if self.startup is None:  # still starting up: the twin's start-up is the measure
            spell = max(spell, twin.startup or 0.0)
        limit = max(floor, factor * spell)
        return quiet if quiet > limit else 0.0

    def idle(self) -> bool:
        now = self._clock()
        resumed = paused.resumed()
        if resumed > self._since:  # nondet was stopped (Ctrl-Z): a new window from then
            self._since, self._cpu_since = resumed, None
        if now - self._last_sample < self._sample:
            return False
        self._last_sample = now
        used = self._cpu(self.pid)
        if used is None:
            return False  # cannot tell: never idle
        if self._cpu_since is None:
            self._since, self._cpu_since = min(self._since, now), used
            return False
        if used - self._cpu_since > BUSY_FRACTION * max(now - self._since, self._sample) \
                or self._runnable(self.pid):
            self._since, self._cpu_since = now, used  # it computes (or would): a new window
            return False
        return now - self._since >= self.after
