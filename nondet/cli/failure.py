"""What a ``check`` or ``run`` that ends without a verdict leaves for CI: the JSON report
(and JUnit) with ``verdict: "error"`` and the exit code the error gets."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import click

from nondet.cli._options import new_or_ours, reader_waiting
from nondet.errors import NondetError, Terminated
from nondet.exitcodes import ExitCode
from nondet.outdir import display


def failure_code(exc: BaseException) -> ExitCode:
    if isinstance(exc, NondetError):
        return exc.exit_code
    if isinstance(exc, click.exceptions.Exit):
        return _known(exc.exit_code)
    if isinstance(exc, click.ClickException):
        return ExitCode.USAGE
    if isinstance(exc, KeyboardInterrupt | click.exceptions.Abort):
        return ExitCode.INTERRUPTED
    if isinstance(exc, Terminated):  # it was "internal error in nondet: Terminated", exit 3
        return ExitCode.TERMINATED
    if isinstance(exc, SystemExit):
        return _known(exc.code if isinstance(exc.code, int) else ExitCode.USAGE)
    return ExitCode.INTERNAL


def captures_kept(exc: BaseException) -> list[str]:
    """The capture files the failed invocation wrote (``kept_in``: its own directory), so
    a CI job that timed out or whose script failed in one run can still ``nondet diff``
    the steps both runs recorded. Never raises: the error itself is what matters."""
    folder = kept_folder(exc)
    if folder is None:
        return []
    try:
        return [str(p) for p in sorted(folder.rglob("*.h5")) if p.is_file()]
    except Exception:
        return []


def kept_folder(exc: BaseException) -> Path | None:
    """The invocation directory an error left (``kept_in``, set as it left the directory's
    ``with``), also where it wraps another (click's Abort wraps the interrupt)."""
    seen: BaseException | None = exc
    while seen is not None and not hasattr(seen, "kept_in"):
        seen = seen.__cause__ or seen.__context__
    return None if seen is None else Path(seen.kept_in)


def _known(code: int) -> ExitCode:
    return ExitCode(code) if code in {int(c) for c in ExitCode} else ExitCode.USAGE


def write_failure(exc: BaseException, name: str, seconds: float, junit_path: Path | None,
                  json_path: Path | None) -> None:
    """A command that could not reach a verdict still leaves its JUnit and JSON for CI (exit
    2, 3 and 130 alike, ``verdict: "error"``); writing them never hides the error itself.
    Never over a file of the user's."""
    from nondet.report import Report, json_file, junit

    if isinstance(exc, SystemExit | click.exceptions.Exit) and not getattr(
            exc, "code", getattr(exc, "exit_code", 1)):
        return  # a clean exit is not a failure
    code = failure_code(exc)
    if code == ExitCode.INTERNAL:
        message = (f"internal error in nondet: {type(exc).__name__}: "
                   f"{(str(exc).splitlines() or [''])[0]} (a bug log is named on stderr)")
    elif code == ExitCode.INTERRUPTED:
        message = "interrupted"
    elif code == ExitCode.TERMINATED:
        name_of = signal.Signals(exc.signum).name if isinstance(exc, Terminated) else "SIGTERM"
        message = f"terminated ({name_of})"
    elif isinstance(exc, click.ClickException):
        message = exc.format_message()
    else:
        message = str(exc)
    message = display(message)
    failed = Report(verdict="error", exit_code=code, runs=[], command=name, notes=[message],
                    captures=captures_kept(exc))
    writers: list[tuple[Path | None, str, Any]] = [
        (junit_path, "--junit", lambda p: junit.write(failed, p, name, seconds, error=message)),
        (json_path, "--json", lambda p: json_file.write(failed, p)),
    ]
    for path, option, write in writers:
        if path is None or str(path) == "-" or not new_or_ours(path, option):
            continue  # never over a file of the user's (the script taken for the path)
        try:
            with reader_waiting(option, path):  # a FIFO nobody reads would hang here
                write(path)
        except Exception:  # the original error is what the user sees
            pass
