"""What nondet's launcher handed it that the script would have been handed under ``python``:
open descriptors and the SIGCHLD disposition.

Descriptors: ``nondet run train.py 3>metrics.log`` (or a make jobserver's pipe, a socket
handed over by a service manager) gave nondet descriptor 3, and a run started without it:
the script's ``os.write(3, ...)`` failed with EBADF and nondet said "the script failed".
The descriptors open when nondet starts (beyond 0-2) are passed to every run and torchrun
agent at the same numbers, as ``python train.py`` would have them; each is checked to still
be the file it was (device and inode) before it is passed, so nothing nondet opened later
at a number the launcher's file had is ever handed to the script.

SIGCHLD: a launcher that sets it to SIG_IGN and execs leaves it ignored (the disposition is
inherited across exec). The kernel then reaps children at once, and ``waitpid`` fails with
ECHILD, which Python's ``subprocess`` reads as exit status 0: a run that aborted (SIGABRT)
or ended with ``os._exit(3)`` counted as a clean end, and a crashing script got
"deterministic", exit 0. nondet's own process waits for its runs with the default
disposition; the script is given back the one it was started with, so it behaves in the
run as it would under ``python`` (where its own ``subprocess`` calls see the same ECHILD).
"""

from __future__ import annotations

import os
import signal

#: Set in nondet's environment (so every run inherits it) when SIGCHLD was ignored.
IGNORED_ENV = "NONDET_SIGCHLD_IGNORED"

_DESCRIPTORS: dict[int, tuple[int, int]] = {}  # number -> (device, inode) at nondet's start


def note_launcher_state() -> None:
    """nondet's process (the CLI), first thing: remember the descriptors it was given, and
    wait for its runs with SIGCHLD at its default."""
    try:
        numbers = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        numbers = []  # no /proc: nothing is passed on, as before
    for fd in numbers:
        if fd > 2:
            identity = _identity(fd)
            if identity is not None:  # (the listing's own descriptor is closed by now)
                _DESCRIPTORS[fd] = identity
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ[IGNORED_ENV] = "1"
    else:  # nondet's word to its runs, never the user's: a value in the caller's
        os.environ.pop(IGNORED_ENV, None)  # environment made the script ignore SIGCHLD


def descriptors() -> tuple[int, ...]:
    """The launcher's descriptors still open as they were (for ``Popen(pass_fds=...)``)."""
    return tuple(fd for fd, identity in sorted(_DESCRIPTORS.items())
                 if _identity(fd) == identity)


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def as_started() -> None:
    """A run, just before the script: SIGCHLD as nondet was started with it."""
    if os.environ.pop(IGNORED_ENV, None) == "1":
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
