"""nondet's two descriptors in a run: kept open when the script closes every descriptor
it inherited, and never used once the script has put something else at their numbers.

Daemon-style code closes all inherited descriptors (``os.closerange(3, MAXFD)``, or
``os.close`` in a loop). Run without nondet there would be no pipe to close at those
numbers, so skipping them keeps the script's behaviour as it would be on its own, and the
run stays recorded. Only calls from Python are seen: a descriptor closed from C, or
``os.dup2`` over one, is caught by ``ours`` (nothing is written, read or closed through a
number the script has reused: ``channel`` asks before each use) and reported by the parent
(``launch.CapturedRun._check_channel_kept``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

# The script may close every inherited descriptor (``os.closerange(3, ...)``, daemon code) or
# ``dup2`` over ours, and then open files of its own that get the same numbers. Writing a
# frame or reading the control pipe through such a number would write into (or read from)
# the user's file, so every use first checks that the number still names the pipe (or file)
# nondet was given: its device and inode, recorded when it was claimed (one fstat per write).
_CLAIMED: dict[int, tuple[int, int]] = {}


def claim(fd: int) -> None:
    """Remember what ``fd`` names now, so that ``ours`` can tell if the script replaced it."""
    identity = _identity(fd)
    if identity is not None:
        _CLAIMED[fd] = identity


def ours(fd: int) -> bool:
    """``fd`` is open and still names what it named when claimed (True if never claimed:
    nothing to compare with)."""
    claimed = _CLAIMED.get(fd)
    return claimed is None or _identity(fd) == claimed


def release(fd: int) -> None:
    """Forget ``fd`` (nondet closed it: the number may name anything next)."""
    _CLAIMED.pop(fd, None)


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        stat = os.fstat(fd)
    except (OSError, ValueError):
        return None
    return stat.st_dev, stat.st_ino


def install(fds: Iterable[int]) -> None:
    """Make ``os.close`` and ``os.closerange`` in this process leave ``fds`` open while
    they name what ``claim`` recorded (forked children close them as they like:
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
        return fd in kept and os.getpid() == pid and ours(fd)

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
