"""nondet's two descriptors in a run: kept open when the script closes every descriptor
it inherited, never used once the script has put something else at their numbers, and
reopened when the script closed them where nondet cannot stop it (from C).

Daemon-style code closes all inherited descriptors (``os.closerange(3, MAXFD)``, or
``os.close`` in a loop). Run without nondet there would be no pipe to close at those
numbers, so skipping them keeps the script's behaviour as it would be on its own, and the
run stays recorded. Only calls from Python are seen: a descriptor closed from C (a library
closing everything before it execs, ``libc.close`` over a range), or ``os.dup2`` over one,
is caught by ``live``: nothing is written, read or closed through a number the script has
reused, and the pipe is opened again through ``/proc/<nondet's pid>/fd/<nondet's end>``
(the same pipe: checked by device and inode). ``watch`` does that within half a second, so
nondet's parent, which sees the pipe lose its writer, hears from the run again before it
gives up on it (``launch.CapturedRun``). Where ``/proc`` cannot be opened the run is lost,
and the parent says so in one line.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

from nondet import own_os, own_threads

# The script may close every inherited descriptor (``os.closerange(3, ...)``, daemon code) or
# ``dup2`` over ours, and then open files of its own that get the same numbers. Writing a
# frame or reading the control pipe through such a number would write into (or read from)
# the user's file, so every use first checks that the number still names the pipe (or file)
# nondet was given: its device and inode, recorded when it was claimed (one fstat per use).
_CLAIMED: dict[int, tuple[int, int]] = {}
#: claimed number -> (path that opens the same pipe again, open flags): ``reachable``
_REOPEN: dict[int, tuple[str, int]] = {}
#: claimed number -> the number it goes by since it was reopened
_LIVE: dict[int, int] = {}
_LOCK = threading.Lock()  # the watcher thread reopens too
WATCH_SECONDS = 0.5


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
    _REOPEN.pop(fd, None)
    _LIVE.pop(fd, None)


def reachable(fd: int, path: str | None, flags: int) -> None:
    """``fd`` (claimed) can be opened again at ``path`` with ``flags`` if the script
    closes it (``live``). Nothing to do without a path (a socket: it cannot be)."""
    if path and fd in _CLAIMED:
        _REOPEN[fd] = (path, flags)


def live(fd: int) -> int:
    """The number that names claimed ``fd``'s pipe now: ``fd`` itself while the script
    leaves it alone, else the pipe opened again (``reachable``); -1 if it cannot be reached.
    Never a number the script has reused for something else. Unclaimed: ``fd``."""
    claimed = _CLAIMED.get(fd)
    if claimed is None:
        return fd
    with _LOCK:
        number = _LIVE.get(fd, fd)
        if _identity(number) == claimed:
            return number
        _LIVE.pop(fd, None)  # the script's number now: its os.close must work on it
        reopened = _reopen(fd, claimed)
        if reopened < 0:
            return -1
        _LIVE[fd] = reopened  # os.close leaves it open too (install)
        return reopened


def _reopen(fd: int, claimed: tuple[int, int]) -> int:
    how = _REOPEN.get(fd)
    if how is None:
        return -1
    path, flags = how
    try:
        # O_NONBLOCK: opening a pipe's end waits for its other end; nondet's parent holds
        # it while it listens, and if it is gone there is nobody to talk to
        number = own_os.open_fd(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return -1
    if _identity(number) != claimed:  # not our pipe (nondet's pid reused?): leave it
        _real(os.close)(number)
        return -1
    own_os.set_blocking(number, True)
    return number


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        stat = own_os.fstat(fd)
    except (OSError, ValueError):
        return None
    return stat.st_dev, stat.st_ino


def _real(function: Callable[..., None]) -> Callable[..., None]:
    return getattr(function, "__wrapped__", function)


def watch(fds: Iterable[int], interval: float = WATCH_SECONDS) -> None:
    """Check ``fds`` every ``interval`` seconds and reopen one the script closed (``live``),
    so that the parent hears from the run again within moments, whether or not the run
    writes soon (a step may take minutes). In this process only: a forked copy's thread
    is gone, and its copies of the pipes are not the run's channel."""
    watched = [fd for fd in fds if fd in _REOPEN]
    if not watched:
        return
    pid = own_os.getpid()

    def loop() -> None:
        while own_os.getpid() == pid:
            time.sleep(interval)
            for fd in watched:
                if fd in _CLAIMED:
                    live(fd)

    own_threads.start(loop)  # Note [Threads the script cannot see] in own_threads.py


def install(fds: Iterable[int]) -> None:
    """Make ``os.close`` and ``os.closerange`` in this process leave ``fds`` (and the numbers
    they are reopened at) open while they name what ``claim`` recorded (forked children
    close them as they like: their copies are not the run's channel)."""
    kept = frozenset(fd for fd in fds if fd >= 0)
    if not kept:
        return
    pid = own_os.getpid()
    real_close: Callable[[int], None] = os.close
    real_closerange: Callable[[int, int], None] = os.closerange

    def guarded(fd: int) -> bool:
        # still the pipe nondet was given: a number the script has dup2'ed its own file
        # onto is the script's to close
        if own_os.getpid() != pid:
            return False
        if fd in kept and ours(fd):
            return True
        # a pipe reopened (``live``) at a number of its own, while it still names it
        return fd in _LIVE.values() and _identity(fd) in _CLAIMED.values()

    def close(fd: int) -> None:
        if guarded(fd):
            return  # as if it had been closed: the script never opened it
        real_close(fd)

    def closerange(fd_low: int, fd_high: int) -> None:
        if own_os.getpid() != pid:
            real_closerange(fd_low, fd_high)
            return
        start = fd_low
        # close around ours, in as few calls as possible
        for fd in sorted(kept | set(_LIVE.values())):
            if fd_low <= fd < fd_high and guarded(fd):
                real_closerange(start, fd)
                start = fd + 1
        real_closerange(start, fd_high)

    close.__wrapped__ = real_close  # type: ignore[attr-defined]
    closerange.__wrapped__ = real_closerange  # type: ignore[attr-defined]
    os.close = close
    os.closerange = closerange


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # a fork may copy it held by the watcher


os.register_at_fork(after_in_child=_after_fork_in_child)
