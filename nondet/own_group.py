"""Child side: a script that signals its own process group signals its own run.

Cleanup code ends every process it started with one call: ``os.killpg(0, SIGTERM)``,
``os.killpg(os.getpgid(own_os.getpid()), SIGKILL)``, ``os.kill(0, sig)``. Run with ``python``
from a terminal, that group is the script and its workers. A run of nondet shares nondet's
process group (so that Ctrl-C and a closing terminal reach the runs as they reach a plain
script), and the same call reached nondet and the other run: nondet said "terminated
(SIGTERM)", exit 143, as if someone had cancelled it, or died without a word on SIGKILL,
its captures left open.

Such a call from Python, naming the group nondet shares, is sent instead to the run's own
processes: the run's process and its descendants still in that group (a descendant that
made a group of its own would not have been in the script's group either), the caller
last. Signal 0 (a check that the group exists) and every other group go through as they
are. A signal sent from C or by a shell (``kill 0``) is not seen.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from nondet import own_os, procstat


def install() -> None:
    """Wrap ``os.killpg`` and ``os.kill`` in this run (its forked processes keep them).
    Only where the run shares its parent's process group: a single run under nondet, not a
    torchrun rank (its agent gives each worker a session of its own)."""
    root, group = own_os.getpid(), os.getpgrp()
    try:
        if os.getpgid(own_os.getppid()) != group:
            return
    except OSError:
        return
    real_killpg, real_kill = os.killpg, os.kill

    def shared(pgid: int) -> bool:
        return pgid == group or (pgid == 0 and os.getpgrp() == group)

    def killpg(pgid: int, sig: int, /) -> None:
        if sig != 0 and shared(pgid):
            _signal_run(root, group, sig, real_kill)
            return
        real_killpg(pgid, sig)

    def kill(pid: int, sig: int, /) -> None:
        if sig != 0 and pid <= 0 and shared(-pid):
            _signal_run(root, group, sig, real_kill)
            return
        real_kill(pid, sig)

    killpg.__doc__, kill.__doc__ = real_killpg.__doc__, real_kill.__doc__
    os.killpg, os.kill = killpg, kill


def _signal_run(root: int, group: int, sig: int, kill: Callable[[int, int], None]) -> None:
    me = own_os.getpid()
    members = [pid for pid in run_processes(root, group) if pid != me]
    for pid in members:
        try:
            kill(pid, sig)
        except ProcessLookupError:
            pass  # ended meanwhile
    kill(me, sig)  # last: the signal may end this process


def run_processes(root: int, group: int) -> list[int]:
    """``root`` and its living descendants whose process group is ``group``, parents first
    ([root] alone where ``/proc`` cannot tell)."""
    stats = procstat.stat_fields()
    if stats is None:
        return [root]
    parents: dict[int, tuple[int, int]] = {}
    for pid, fields in stats.items():
        try:
            parents[pid] = (int(fields[1]), int(fields[2]))
        except (IndexError, ValueError):
            continue
    found, frontier = [], [root]
    while frontier:
        current = frontier.pop(0)
        if current in found:
            continue
        if current == root or parents.get(current, (0, 0))[1] == group:
            found.append(current)
        frontier.extend(pid for pid, (parent, _) in parents.items() if parent == current)
    return found
