"""Keep nondet's pipe open when the script closes every descriptor it inherited.

Daemon-style code closes all inherited descriptors (``os.closerange(3, MAXFD)``, or
``os.close`` in a loop). Run without nondet there would be no pipe to close at those
numbers, so skipping them keeps the script's behaviour as it would be on its own, and the
run stays recorded. Only calls from Python are seen: a descriptor closed from C, or
``os.dup2`` over one, is caught by ``channel.ours`` (nothing is written through a number
the script has reused) and reported by the parent
(``launch.CapturedRun._check_channel_kept``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from nondet import channel


def install(fds: Iterable[int]) -> None:
    """Make ``os.close`` and ``os.closerange`` in this process leave ``fds`` open while
    they name what ``channel.claim`` recorded (forked children close them as they like:
    their copies are not the run's channel)."""
    kept = frozenset(fd for fd in fds if fd >= 0)
    if not kept:
        return
    pid = os.getpid()
    real_close: Callable[[int], None] = os.close
    real_closerange: Callable[[int, int], None] = os.closerange

    def guarded(fd: int) -> bool:
        # still the pipe nondet was given: a number the script has dup2'ed its own file
        # onto is the script's to close
        return fd in kept and os.getpid() == pid and channel.ours(fd)

    def close(fd: int) -> None:
        if guarded(fd):
            return  # as if it had been closed: the script never opened it
        real_close(fd)

    def closerange(fd_low: int, fd_high: int) -> None:
        if os.getpid() != pid:
            real_closerange(fd_low, fd_high)
            return
        start = fd_low
        for fd in sorted(kept):  # close around ours, in as few calls as possible
            if fd_low <= fd < fd_high and guarded(fd):
                real_closerange(start, fd)
                start = fd + 1
        real_closerange(start, fd_high)

    close.__wrapped__ = real_close  # type: ignore[attr-defined]
    closerange.__wrapped__ = real_closerange  # type: ignore[attr-defined]
    os.close = close
    os.closerange = closerange
