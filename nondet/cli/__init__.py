"""Command line: ``nondet run | diff | show`` (click only: parse, call, render).

Nothing here imports torch, TensorFlow or h5py at module level, so ``nondet --help`` is
instant and works where no framework is installed.
"""

from __future__ import annotations

import os
import sys

import click

from nondet import __version__, inherited, terminal
from nondet.cli._common import App, ReaderMayGo, handle_errors
from nondet.cli._options import require_cwd
from nondet.errors import NondetError
from nondet.exitcodes import EPILOG


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EPILOG,
)
@click.version_option(__version__, prog_name="nondet")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Find where run-to-run nondeterminism enters a training job.

    \b
    nondet run train.py --epochs 1      run a script twice, find the first difference
    nondet check train.py               the same as a CI gate: exit 0 or 1, JUnit, JSON
    nondet diff a.h5 b.h5               compare two captures from anywhere
    nondet show run-a.h5                what a capture holds
    nondet fixes                        the fixes nondet can apply (--apply FIX_ID)
    nondet report report.json --html r.html   the HTML report of a JSON report or captures
    """
    ctx.obj = App()


def _register() -> None:
    from nondet.cli import check, diff, fixes, report, run, show

    cli.add_command(run.run)
    cli.add_command(check.check)
    cli.add_command(diff.diff)
    cli.add_command(show.show)
    cli.add_command(fixes.fixes)
    cli.add_command(report.report)


_register()


def main() -> None:
    """Console-script entry point: exit codes as the README lists them."""
    try:
        _main()
    except SystemExit as exc:
        if sys.flags.inspect or os.environ.get("PYTHONINSPECT"):
            # PYTHONINSPECT=1 (or `python -i`): Python would print this SystemExit as a
            # traceback and start a prompt, which on a closed stdin ends with status 1 --
            # "nondeterminism found" -- whatever the verdict. A command ends with its code.
            _exit_now(exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1)
        raise


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _main() -> None:
    _reopen_closed_standard_streams()
    _encode_anything()
    inherited.note_launcher_state()  # descriptors the runs get; SIGCHLD at its default
    if not isinstance(sys.stdout, ReaderMayGo):  # `nondet check ... | head -1`
        sys.stdout = ReaderMayGo(sys.stdout)
    if not isinstance(sys.stderr, ReaderMayGo):  # `... 2>&1 | head -1`: progress lines
        sys.stderr = ReaderMayGo(sys.stderr)
    with handle_errors(), terminal.settings_kept():  # a script's prompt may leave echo off
        if not _only_help(sys.argv[1:]):
            require_cwd()  # every command resolves paths against it (diff, show and report too)
        code = cli.main(standalone_mode=False)
        _report_reached_stdout()
        sys.exit(int(code or 0))


def _only_help(args: list[str]) -> bool:
    """``--help``/``--version`` answer from anywhere, a deleted current directory included."""
    return any(arg in ("-h", "--help", "--version") for arg in args)


def _reopen_closed_standard_streams() -> None:
    """``nondet check ... >&- 2>&-`` (cron, a service with its streams closed): Python left
    ``sys.stdout``/``sys.stderr`` None, and nondet failed with "internal error" and exit 120
    (even for a missing file). The closed descriptor is put on /dev/null, which also keeps a
    file nondet opens next (a capture) from taking number 1 or 2, where a library's own
    printing would go into it. What nondet says there is lost, as the user chose; the exit
    code stays the verdict's."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:  # a lower number was free too: that one is handled in its turn
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            mode = "r" if fd == 0 else "w"
            setattr(sys, name, open(fd, mode, encoding="utf-8", closefd=False))  # noqa: SIM115 (kept for the process)


def _encode_anything() -> None:
    """Every character nondet prints reaches the stream. Under a locale that is not UTF-8
    (``LC_ALL=C PYTHONUTF8=0``, a Latin-1 locale) stdout's codec is ASCII or Latin-1 and
    strict: the verdict's em dash, a script's non-ASCII name or a recipe's arrow failed as
    "internal error", exit 3, after both runs had finished. Such characters are written
    as ``\\uXXXX`` escapes instead (what Python does on stderr already)."""
    import codecs

    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            utf = codecs.lookup(encoding).name.startswith("utf")
        except LookupError:
            utf = False
        reconfigure = getattr(stream, "reconfigure", None)
        if not utf and reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (OSError, ValueError):  # a stream that cannot change now: left as it is
                pass


def _report_reached_stdout() -> None:
    """A report that could not be written to stdout (``> out.txt`` on a full disk) is the
    machine's trouble: one line and exit 2, not the verdict's code for a report nobody got
    (a reader that went away, ``| head -1``, keeps the verdict's code)."""
    failed = getattr(sys.stdout, "failed", None)
    if failed is not None:
        raise NondetError(f"could not write the report to stdout ({failed.strerror or failed}): "
                          "free space where stdout goes, or give --json PATH elsewhere")
