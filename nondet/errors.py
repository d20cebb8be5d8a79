"""The one user-facing error type: printed as a single line, never with a traceback."""

from __future__ import annotations

from nondet.exitcodes import ExitCode


class NondetError(Exception):
    """A problem the user can fix. The message says what to do; the exit code is 2."""

    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, message: str, *, details: str = "") -> None:
        super().__init__(message)
        self.details = details  # extra lines shown below the message (e.g. a script's stderr tail)


class ScriptFailed(NondetError):
    """The user's script exited with an error in one or both runs."""


class Terminated(BaseException):
    """nondet got SIGTERM (CI cancel, ``timeout``, ``docker stop``): end like Ctrl-C (exit
    143), but the children did not get the signal, so it is forwarded to them. Not a
    KeyboardInterrupt: click would turn that into its own Abort."""
