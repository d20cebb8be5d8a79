"""What every command shares: the console, and turning errors into exit codes."""

from __future__ import annotations

import io
import os
import platform
import shlex
import signal
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, TextIO

import click
from rich.console import Console

from nondet import __version__, errors, paused, settings
from nondet.errors import NondetError, Terminated
from nondet.exitcodes import ExitCode
from nondet.printable import LINE_MAX, clip


class SafeConsole(Console):
    """A console that never passes a control character of its text to the terminal.

    Paths, script names, exception messages and module names come from the user's program
    or a capture; an ESC in one (a script named ``$'a\\x1b[2Jb.py'``) reached the terminal
    raw from progress lines and error messages. Styles are added by rich after this, so
    colour still works; line breaks are kept (messages may span lines)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        from nondet.printable import printable

        super().print(*(printable(o, newlines=True) if isinstance(o, str) else o
                        for o in objects), **kwargs)


def _width(tty: bool, piped: int | None) -> int | None:
    """A console's width: None lets rich read the terminal or COLUMNS; piped output gets
    ``piped`` (None: rich's own default) unless COLUMNS says. A COLUMNS that is no
    sensible width is ignored: COLUMNS=0 printed nothing at all, COLUMNS=abc ended every
    command with exit 3."""
    columns = os.environ.get("COLUMNS")
    sensible = columns is not None and columns.strip().isdigit() and int(columns) >= 20
    if sensible:
        return None if tty else int(columns)  # type: ignore[arg-type]
    if columns is None:
        return None if tty else piped
    if tty:  # rich would read the COLUMNS given: ask the terminal itself
        try:
            return max(20, os.get_terminal_size().columns)
        except OSError:
            return 80
    return piped if piped is not None else 80


class App:
    """Shared state of one invocation (consoles; stdout for results, stderr for progress)."""

    def __init__(self) -> None:
        # Piped output gets a roomy fixed width (rich would use 80) unless COLUMNS says.
        self.out = SafeConsole(highlight=False, soft_wrap=True,
                               width=_width(sys.stdout.isatty(), piped=120))
        self.err = SafeConsole(stderr=True, highlight=False, soft_wrap=True,
                               width=_width(sys.stderr.isatty(), piped=None))


@contextmanager
def handle_errors() -> Iterator[None]:
    """One line and exit 2 for user errors, a log and exit 3 for bugs, 130 for Ctrl-C,
    143 for SIGTERM."""
    err = SafeConsole(stderr=True, highlight=False, soft_wrap=True)
    _terminate_on_sigterm()
    paused.install()  # time nondet spends stopped (Ctrl-Z) is no run's silence
    errors.watch_sigint()
    try:
        settings.check()  # before anything runs: a mistyped NONDET_* value is one line
        yield
    except Terminated as exc:
        err.print(f"nondet: terminated ({signal.Signals(exc.signum).name}); runs stopped, "
                  "captures written so far closed, each marked with how its run ended"
                  + _kept(exc))
        sys.exit(ExitCode.TERMINATED)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort as exc:
        err.print("nondet: interrupted" + _kept(exc))
        sys.exit(ExitCode.INTERRUPTED)
    except click.ClickException as exc:
        shown = io.StringIO()  # the usage error quotes what was typed: control bytes too
        exc.show(file=shown)
        err.print(shown.getvalue().rstrip("\n"), markup=False)
        sys.exit(ExitCode.USAGE)
    except NondetError as exc:
        err.print(f"[bold red]nondet: error:[/] {_escape(str(exc))}")
        if exc.details and os.environ.get("NONDET_QUIET_DETAILS") != "1":
            for line in exc.details.splitlines()[-15:]:
                err.print(f"  | {_escape(clip(line, LINE_MAX))}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:
        err.print("nondet: interrupted; captures written so far are kept" + _kept(exc))
        sys.exit(ExitCode.INTERRUPTED)
    except SystemExit:
        raise
    except BaseException as exc:  # a bug in nondet, unless the machine is the trouble
        from nondet.cli import _trouble

        trouble = _trouble.explain(exc)
        if trouble is None:
            _internal_error(err, exc)
        err.print(f"[bold red]nondet: error:[/] {_escape(trouble)}")
        sys.exit(ExitCode.USAGE)


def _kept(exc: BaseException) -> str:
    """Where an interrupted invocation's captures are and how to read them: the steps both
    runs recorded still answer the question (a script that trains and then never ends is
    stopped with Ctrl-C; the message said only "interrupted")."""
    from nondet.cli.failure import kept_folder
    from nondet.outdir import display

    folder = kept_folder(exc)
    if folder is None:
        return ""
    pair = [folder / f"run-{label}.h5" for label in "ab"]
    if not all(p.is_file() for p in pair):
        return f"; they are in {display(folder)}"
    return (f"; `nondet diff {shlex.quote(display(pair[0]))} {shlex.quote(display(pair[1]))}` "
            "compares the steps both "
            "runs recorded")


def _internal_error(err: Console, exc: BaseException) -> NoReturn:
    """A bug in nondet (called while handling ``exc``): exit 3, with a log holding versions
    and the traceback."""
    if os.environ.get("NONDET_DEBUG") == "1":
        raise exc
    details = getattr(exc, "child_traceback", "")
    text = traceback.format_exc()
    log = write_bug_log(text, details)
    err.print(f"[bold red]nondet: internal error:[/] {_escape(type(exc).__name__)}: "
              f"{_escape(str(exc).splitlines()[0] if str(exc) else '')}")
    if log is not None:
        err.print(f"  a log with versions and the traceback is at {log}; please report it")
    else:
        err.print("  no log could be written (cache, temporary and current directories "
                  "refused it); please report this traceback:")
        for line in text.splitlines()[-15:]:
            err.print(f"  | {_escape(line)}")
    sys.exit(ExitCode.INTERNAL)


#: Signals that end nondet as SIGTERM does. SIGHUP (a closed terminal or ssh session, ``kill
#: -HUP``) killed nondet at once: its runs went on training as orphans and the captures were
#: left open for writing, unreadable ("file is already open for write"). SIGUSR1 and SIGUSR2
#: (Slurm's ``--signal=USR1@60`` before a job's time limit, ``scancel --signal``) ended nondet
#: silently with exit 138 or 140: their default action too is to end the process.
TERMINATING = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _terminate_on_sigterm() -> None:
    """SIGTERM (CI cancel, `timeout`, `docker stop`), SIGHUP, SIGUSR1 or SIGUSR2 ends nondet
    as Ctrl-C does: the runs are interrupted and their captures closed (errors.Terminated),
    then exit 143 (the contract's one code for "terminated", whichever signal it was)."""

    def handler(signum: int, frame: object) -> None:
        for sig in TERMINATING:  # once: let the clean-up finish
            signal.signal(sig, signal.SIG_IGN)
        if errors.end_once():  # not after a Ctrl-C whose clean-up is under way
            raise Terminated(signum)

    try:
        for sig in TERMINATING:
            current = signal.getsignal(sig)
            if current is signal.SIG_DFL or (sig in (signal.SIGTERM, signal.SIGHUP)
                                             and current is not signal.SIG_IGN):
                # (`nohup nondet ...` keeps SIGHUP ignored; a handler someone set for
                # SIGUSR1, faulthandler's, stays theirs)
                signal.signal(sig, handler)
    except ValueError:
        pass  # not the main thread (nondet used as a library): leave signals alone


def write_bug_log(text: str, child: str = "") -> Path | None:
    """The bug report written where it can be: the user's cache, the temporary directory,
    the current directory; None if none takes it (a read-only file system: it was an
    exception inside the error handler, and exit 1, "nondeterminism found", for a bug)."""
    versions = [f"nondet {__version__}", f"python {platform.python_version()}",
                f"platform {platform.platform()}"]
    for module in ("numpy", "h5py", "torch", "tensorflow"):
        mod = sys.modules.get(module)
        if mod is not None:
            versions.append(f"{module} {getattr(mod, '__version__', '?')}")
    body = "# nondet bug report\n\n" + "\n".join(f"- {v}" for v in versions)
    body += f"\n- command: {' '.join(sys.argv)}\n\n```\n{text}\n```\n"
    if child:
        body += f"\nInside the recorded run:\n\n```\n{child}\n```\n"
    name = f"nondet-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nondet"
    for base in (cache, Path(tempfile.gettempdir()), Path(os.curdir)):
        try:
            base = base.absolute()  # the current directory may be gone: OSError
            base.mkdir(parents=True, exist_ok=True)
            # Paths and arguments may hold bytes that are not UTF-8 (surrogate escapes): the
            # log shows them as \xNN rather than failing inside the error handler.
            (base / name).write_text(_printable(body), encoding="utf-8")
        except (OSError, RuntimeError):  # RuntimeError: Path.home() without a home
            continue
        return base / name
    return None


def _printable(text: str) -> str:
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(_printable(text))


class ReaderMayGo:
    """``sys.stdout`` whose reader may go away (``nondet check train.py | head -1``): what
    is written after that is dropped, never an error. Without it click turned the broken
    pipe into exit 1, "nondeterminism found", for a deterministic run; the exit code stays
    the verdict's.

    A stream that refuses writes otherwise (``> out.txt`` on a full disk, ``/dev/full``, a
    terminal that hung up: EIO) is dropped the same way, so the runs and their captures
    still end as they should, but the failure is kept (``failed``): the caller says in one
    line that the report was lost (it was "internal error", exit 3, a bug log)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False
        self.failed: OSError | None = None  # the write error, other than a reader gone

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except OSError as exc:
                self._reader_gone(exc)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except OSError as exc:
                self._reader_gone(exc)

    def _reader_gone(self, exc: OSError) -> None:
        self.gone = True
        if not isinstance(exc, BrokenPipeError):
            self.failed = exc
        # the text still buffered, and the interpreter's last flush, go nowhere quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
