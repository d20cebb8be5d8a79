"""The one user-facing error type: printed as a single line, never with a traceback."""

from __future__ import annotations

import signal
from types import FrameType

from nondet.exitcodes import ExitCode


class NondetError(Exception):
    """A problem the user can fix. The message says what to do; the exit code is 2."""

    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, message: str, *, details: str = "") -> None:
        super().__init__(message)
        self.details = details  # extra lines shown below the message (e.g. a script's stderr tail)


class ScriptFailed(NondetError):
    """The user's script exited with an error in one or both runs."""


class CaptureNotWritten(NondetError):
    """A run's capture could not be written (a full disk, a file-size limit) and the runs
    were stopped: the re-runs after a finding keep the finding and say so."""


class Terminated(BaseException):
    """nondet got SIGTERM (CI cancel, ``timeout``, ``docker stop``) or SIGHUP (its terminal
    closed): end like Ctrl-C (exit 143), but the children did not
    get the signal, so it is forwarded to them. Not a KeyboardInterrupt: click would turn
    that into its own Abort."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


# -- was nondet itself interrupted? ----------------------------------------------------------
# A run that ends with KeyboardInterrupt was either interrupted with nondet (Ctrl-C reaches
# the whole process group) or raised it on its own (``raise KeyboardInterrupt``, a SIGINT
# sent to that process only): the first is exit 130, the second the script's own failure.
_sigint = {"watched": False, "seen": False}


def watch_sigint() -> None:
    """Note when nondet gets SIGINT, raising KeyboardInterrupt as Python's own handler does
    (left alone when SIGINT is ignored, or outside the main thread): once. Another SIGINT
    while nondet ends its runs is ignored, as a SIGTERM then is (``end_once``): `timeout`
    forwards a Ctrl-C to nondet and again to its group, and a second KeyboardInterrupt in
    the middle of the clean-up left runs going and captures open ("release unlocked lock"
    from a Condition it cut short, exit 3; or a hang at exit on h5py's lock)."""
    def handler(signum: int, frame: FrameType | None) -> None:
        if not end_once():
            return
        _sigint["seen"] = True
        raise KeyboardInterrupt

    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, handler)
            _sigint["watched"] = True
    except ValueError:
        pass  # not the main thread (nondet used as a library)


_ending = {"now": False}


def end_once() -> bool:
    """True the first time nondet is told to end (SIGINT, SIGTERM or SIGHUP), False after:
    the signal handlers raise only then, so the clean-up the first one started finishes
    (each of its waits is bounded)."""
    first = not _ending["now"]
    _ending["now"] = True
    return first


def interrupted_here() -> bool:
    """nondet got SIGINT (True too when nobody watched: nothing to tell it by)."""
    return _sigint["seen"] or not _sigint["watched"]
