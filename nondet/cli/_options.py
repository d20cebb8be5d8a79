"""Options shared by ``nondet run`` and ``nondet check`` (the target and how to run it)."""

from __future__ import annotations

import codecs
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from nondet import outdir
from nondet.errors import NondetError
from nondet.exitcodes import EPILOG

if TYPE_CHECKING:  # runspec (and the session config) loads only for run and check
    from nondet.runspec import Target

F = Callable[..., Any]

#: What every seed consumer in the children takes (PYTHONHASHSEED and NumPy's legacy RNG
#: stop at 2**32 - 1; a negative seed would be folded onto another one silently).
SEED_RANGE = click.IntRange(0, 2**32 - 1)


class TargetCommand(click.Command):
    """A command whose options come before SCRIPT: keeps the raw arguments, so that an
    unknown option in the script's place can be told from a script given after ``--``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["nondet.raw_args"] = list(args)
        return super().parse_args(ctx, args)

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        """Help only for ``-h``/``--help`` as written: click also reads the ``h`` in an
        unknown cluster (a script ``-dash.py`` written without ``--``) as ``-h``, and
        ``nondet check -dash.py`` then printed help and exited 0, a pass in CI."""
        option = super().get_help_option(ctx)
        if option is None or option.callback is None:
            return option
        show_help = option.callback

        def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
            raw: list[str] = ctx.meta.get("nondet.raw_args", [])
            ours = raw[: raw.index("--")] if "--" in raw else raw
            if value and not ctx.resilient_parsing and not {"-h", "--help"} & set(ours):
                cluster = next((a for a in ours if a.startswith("-") and "h" in a[1:]
                                and not a.startswith("--")), "?")
                raise click.UsageError(f"no such option: {outdir.display(cluster)} (nondet's "
                                       "options go before the script; a script whose name "
                                       "starts with '-' goes after `--`)")
            return show_help(ctx, param, value)

        option.callback = callback
        return option


def target_command(cls: type[TargetCommand] = TargetCommand) -> Callable[[F], click.Command]:
    """Declare a command that runs a target (``run``, ``check``): options first, then SCRIPT
    and everything after it, passed to the script unparsed; ``target_options`` included."""

    def declare(function: F) -> click.Command:
        return click.command(
            cls=cls,
            context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
            epilog=EPILOG,
        )(target_options(function))

    return declare


def target_options(command: F) -> F:
    """-m, --seed, --out, --json, --html, --ops, --max-steps, --runs, --schedule, --apply and
    SCRIPT ARGS."""
    for option in reversed([
        click.option("-m", "module", metavar="MODULE",
                     help="Run a module as with `python -m MODULE` (instead of a script path)."),
        click.option("--seed", default=0, show_default=True, type=SEED_RANGE,
                     help="Seed for random, NumPy, the framework and PYTHONHASHSEED in every "
                          "run."),
        click.option("--out", "out_dir", default=".nondet", show_default=True,
                     # checked by outdir.check_root, whose line names what to do (the
                     # default too: a file named .nondet in the working directory)
                     type=click.Path(path_type=Path),
                     help="Where the capture files (.h5) and the runs' output logs go."),
        click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
                     help="Also write the report as JSON to this file."),
        click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
                     help="Also write the report as one self-contained HTML page (needs the "
                          "extra `html`)."),
        click.option("--ops", type=click.Choice(["auto", "all"]), default="auto",
                     show_default=True,
                     help="Op-level capture: `auto` for init and step 0, then only where the "
                          "runs differ (re-runs); `all` for every step (rare nondeterminism)."),
        click.option("--max-steps", type=click.IntRange(min=1), metavar="N",
                     help="Stop each run after N training steps."),
        click.option("--runs", type=click.IntRange(min=2, max=MAX_RUNS), default=2,
                     show_default=True, metavar="N",
                     help="Run N times (one after the other), show how each ended and how many "
                          "distinct outcomes there were, and explain the first run that "
                          f"differs from the first (at most {MAX_RUNS})."),
        click.option("--schedule", type=click.Choice(["auto", "lockstep", "sequential"]),
                     default="auto", show_default=True,
                     help="How two runs share the machine: `lockstep` runs both at once, "
                          "taking turns step by step (both stop early when they differ); "
                          "`sequential` runs one after the other (half the memory: the default "
                          "on GPU machines)."),
        click.option("--apply", "apply", multiple=True, metavar="FIX_ID",
                     callback=_known_fixes,
                     help="Run both runs with this fix applied from outside the script "
                          "(repeatable); `nondet fixes` lists them."),
        click.option("--nproc-per-node", type=click.IntRange(min=1), metavar="N",
                     expose_value=False, callback=_remember_nproc,
                     help="Run SCRIPT as a single-node torchrun job of N processes (the "
                          "same as `torchrun --nproc-per-node N SCRIPT`); or write your own "
                          "launch line after the options: `torchrun [TORCHRUN_ARGS] SCRIPT`."),
        click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED,
                       metavar="SCRIPT [ARGS]..."),
    ]):
        command = option(command)
    return command


def _remember_nproc(ctx: click.Context, _param: click.Parameter,
                    value: int | None) -> None:
    ctx.meta["nondet.nproc_per_node"] = value  # read by make_target (run and check alike)


#: --verify-pairs beyond this is a typo more often than a plan: each pair is two whole runs
#: per fix tried, and the re-checks are not bounded by --verify-budget.
MAX_VERIFY_PAIRS = 20
#: --runs: a count past this is a typo, not a plan (each run is a whole run of the script).
MAX_RUNS = 1000


def _a_number(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """FloatRange lets NaN through (every comparison with it is false)."""
    if value is not None and value != value:
        raise click.BadParameter("nan is not a number of seconds", ctx=ctx, param=param)
    return value


def verify_options(command: F) -> F:
    """--max-fixes, --verify-steps, --verify-budget: how far fix verification goes."""
    for option in reversed([
        click.option("--max-fixes", type=click.IntRange(min=1), default=3, show_default=True,
                     metavar="N",
                     help="Verify fixes for at most N sources (each verified fix stays "
                          "applied while the next source is looked for)."),
        click.option("--verify-steps", type=click.IntRange(min=1), metavar="N",
                     help="Steps the runs with every verified fix compare (default: the whole "
                          "script, or --max-steps)."),
        click.option("--verify-budget", type=click.FloatRange(min=0, min_open=True),
                     default=900, show_default=True, metavar="SECONDS", callback=_a_number,
                     help="Wall time for finding further sources; what is left unexamined "
                          "when it runs out is said in the report."),
        click.option("--verify-pairs", type=click.IntRange(min=1, max=MAX_VERIFY_PAIRS),
                     default=1, show_default=True, metavar="N",
                     help="A fix is verified only if the runs repeat with it in N pairs "
                          "(more confidence for rare races; each pair is two more runs; "
                          f"at most {MAX_VERIFY_PAIRS})."),
    ]):
        command = option(command)
    return command


def _known_fixes(_ctx: click.Context, _param: click.Parameter,
                 value: tuple[str, ...]) -> tuple[str, ...]:
    from nondet import interventions

    bad = interventions.unknown(value)
    if bad:
        raise click.BadParameter(f"no fix named {bad[0]}; `nondet fixes` lists the ones "
                                 "nondet can apply", param_hint="--apply")
    return value


def _check_script_path(script: str) -> None:
    """One line for a script path each run could not open as the user meant (before, a name
    too long was "internal error", exit 3; ``/dev/stdin`` ran an empty script, since each
    run has stdin of its own, and was told "no training step was observed")."""
    try:
        os.stat(script)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return  # Target.check: "script not found"
        if exc.errno == errno.ELOOP:
            raise NondetError(f"the script {script} is a symbolic link that leads back to "
                              "itself: give the script's own path") from None
        raise NondetError(f"cannot open the script {script}: {exc.strerror}") from None
    if os.path.abspath(script).startswith(("/dev/", "/proc/")):
        raise NondetError(f"the script {script} is a device or a descriptor of nondet's own "
                          "process, which each run opens anew (the runs have stdin of their "
                          "own): save the script to a file and give that file")


def make_target(module: str | None, script_and_args: tuple[str, ...],
                launcher: tuple[str, ...] | None = None) -> Target:
    """The script (or module) and its arguments; unknown options and paths nondet cannot
    store are usage errors (exit 2), found before anything runs."""
    from nondet import launchline
    from nondet.runspec import Target

    if launchline.is_launch_line(script_and_args, module):
        target = launchline.parse_launch_line(script_and_args, module)
        return make_target(target.module, (*([target.script] if target.script else []),
                                           *target.args), launcher=target.launcher)
    if module is not None and not module.strip():
        # (an empty -m fell through to the next argument: `-m '' x.py` ran x.py)
        raise click.UsageError("-m needs a module name, as `python -m package.module` does")
    if module is None and script_and_args[:1] == ("-",):
        raise click.UsageError("nondet cannot read the script from standard input (`python -`): "
                               "it runs the script twice; save it to a file and name that")
    _refuse_unknown_option(module, script_and_args)
    if module:
        target = Target(script=None, module=module, args=tuple(script_and_args))
    elif not script_and_args:
        raise click.UsageError("missing SCRIPT (or -m MODULE): what should nondet run?")
    else:
        script, *args = script_and_args
        target = Target(script=script, module=None, args=tuple(args))
    for what, value in (("the script", target.script or ""), ("the module", module or ""),
                        ("the current directory", require_cwd())):
        require_utf8(what, value)
    for arg in target.args:
        require_utf8("an argument of the script", arg)
    if target.script is not None:
        _check_script_path(target.script)
    target.check()
    ctx = click.get_current_context(silent=True)
    nproc = ctx.meta.get("nondet.nproc_per_node") if ctx is not None else None
    if launcher is not None:
        if nproc is not None:
            raise click.UsageError("--nproc-per-node is for a bare SCRIPT; with a torchrun "
                                   "launch line, give it to torchrun")
        return replace(target, launcher=launcher)
    if nproc is not None:
        return launchline.shorthand(int(nproc), target)
    return target


def _refuse_unknown_option(module: str | None, script_and_args: tuple[str, ...]) -> None:
    """With ``ignore_unknown_options`` an unknown option lands in SCRIPT's place; it is a
    usage error unless it was written after ``--`` (a script named ``-x.py``)."""
    if not script_and_args or not script_and_args[0].startswith("-"):
        return
    ctx = click.get_current_context(silent=True)
    raw: list[str] = ctx.meta.get("nondet.raw_args", []) if ctx is not None else []
    first = script_and_args[0]
    if module:
        # `-m MODULE --its-option`: fine; `--bogus -m MODULE`: the option was nondet's.
        where_m = next((i for i, a in enumerate(raw) if a == "-m" or
                        (a.startswith("-m") and a[2:] == module)), len(raw))
        if first not in raw[:where_m]:
            return
    elif "--" in raw and tuple(raw[raw.index("--") + 1:]) == script_and_args:
        return
    name = outdir.display(first.split("=", 1)[0])
    raise click.UsageError(f"no such option: {name} (nondet's options go before the script; "
                           "a script whose name starts with '-' goes after `--`)")


def require_cwd() -> str:
    """The current directory; one line if it was deleted under the shell (``diff`` from
    there printed its verdict, then failed inside the error handler with exit 1)."""
    try:
        return os.getcwd()
    except OSError as exc:
        raise NondetError(f"the current directory is gone: {exc.strerror}; cd to one that "
                          "exists") from exc


def require_utf8(what: str, value: str | os.PathLike[str]) -> None:
    """Captures store paths and arguments as UTF-8 text: refuse what cannot be stored."""
    text = os.fspath(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        encoding = sys.getfilesystemencoding()
        if _is_utf8(text) and codecs.lookup(encoding).name != "utf-8":
            # The bytes are UTF-8: this interpreter reads them as ASCII (LC_ALL=C with
            # PYTHONUTF8=0), so "a byte that is not UTF-8" was false.
            raise NondetError(
                f"{what} is not ASCII ({outdir.display(text)}), and this Python decodes paths "
                f"and arguments as {encoding} (the locale is not UTF-8"
                f"{', and PYTHONUTF8=0' if os.environ.get('PYTHONUTF8') == '0' else ''}); "
                "nondet stores them as UTF-8 text: run it with PYTHONUTF8=1 "
                "or under a UTF-8 locale (LC_ALL=C.UTF-8)") from None
        raise NondetError(f"{what} has a byte that is not UTF-8 ({outdir.display(text)}); "
                          "nondet stores paths and arguments as UTF-8 text: rename it") from None


def _is_utf8(text: str) -> bool:
    try:
        os.fsencode(text).decode("utf-8")
    except (UnicodeError, ValueError):
        return False
    return True


def check_output_file(path: Path | None, option: str) -> None:
    """Refuse a report file nondet will not be able to write, before the runs start."""
    if path is None:
        return
    if str(path) == "-":
        raise NondetError(f"{option} -: give a file path (the report on standard output is "
                          "the text one; `--json` writes a file)")
    require_utf8(option, path)
    if path.is_dir():
        raise NondetError(f"{option} {outdir.display(path)} is a directory, not a file")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NondetError(f"{option} {outdir.display(path)}: {outdir.display(existing)} is a "
                          "file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK) or (path.exists()
                                                       and not os.access(path, os.W_OK)):
        raise NondetError(f"{option} {outdir.display(path)}: not writable")
    if option in OURS and not new_or_ours(path, option):
        raise NondetError(f"{option} {outdir.display(path)}: that file exists and is no "
                          f"{OURS[option][0]} of nondet's, so it is left alone (was the path "
                          "forgotten, and the script taken for it?): give a new path or "
                          "remove the file")


def check_distinct(outputs: dict[str, Path | None]) -> None:
    """Refuse two report options naming one file: the second written silently replaced
    the first (``--json r --html r``)."""
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise NondetError(f"{seen[key]} and {option} name the same file "
                              f"{outdir.display(path)}: give each its own path")
        seen[key] = option


#: The files nondet writes over when asked: what they are, and what the start of each holds
#: (a JSON report, JUnit, HTML; a capture's root attribute, a few KiB into the file).
OURS: dict[str, tuple[str, tuple[bytes, ...], int]] = {
    "--json": ("report", (b'"nondet_report_version"',), 4096),
    "--junit": ("report", (b'<testsuites name="nondet"',), 4096),
    "--html": ("report", (b"<title>nondet: ",), 4096),
    "--baseline": ("capture", (b"nondet_format_version",), 1 << 20),
}


def new_or_ours(path: Path, option: str) -> bool:
    """True unless ``path`` is a file whose content is not what nondet writes for
    ``option``. Such a file is never overwritten: `nondet check --junit train.py` (the
    report's path forgotten) wrote the JUnit XML over the user's script, `--update-baseline
    --baseline model.h5` would write over the user's weights."""
    _, marks, limit = OURS[option]
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return True  # nothing to lose (or /dev/null, a FIFO: not a file's content)
        with path.open("rb") as f:
            head = f.read(limit)
    except OSError:
        return True  # the write itself will say what is wrong
    return any(mark in head for mark in marks)


def write_output(option: str, path: Path, write: Callable[[], None]) -> None:
    """Write a report file; trouble is the user's to fix (exit 2), not a nondet bug."""
    try:
        with reader_waiting(option, path):
            write()
    except OSError as exc:
        raise NondetError(f"cannot write {option} {outdir.display(path)}: "
                          f"{exc.strerror or exc}") from exc


@contextmanager
def reader_waiting(option: str, path: Path) -> Iterator[None]:
    """For a FIFO (a named pipe; ``>(jq .)`` is one too): refuse it when no program reads
    it, where opening it to write would wait for one for ever; else hold it open while the
    report is written, so its reader does not see the end of the data in between."""
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        fifo = False  # a new file, or one the write itself will explain
    if not fifo:
        yield
        return
    try:
        held = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            raise
        raise NondetError(
            f"cannot write {option} {outdir.display(path)}: it is a FIFO and no program "
            "reads it; start its reader first, or give a file") from None
    try:
        yield
    finally:
        os.close(held)


@contextmanager
def invocation(out_dir: Path) -> Iterator[Path]:
    """This invocation's own directory under --out; ``latest`` points at it at the end."""
    require_utf8("--out", out_dir)
    made = outdir.start(out_dir)
    try:
        yield made.path
    except BaseException as exc:  # where the message and the error's JSON point
        with suppress(Exception):
            exc.kept_in = made.path  # type: ignore[attr-defined]
        raise
    finally:
        outdir.finish(made)


def make_options(*, seed: int, out_dir: Path, ops: str, max_steps: int | None, schedule: str,
                 verbose: bool, apply: tuple[str, ...] = (), verify: bool = False,
                 max_fixes: int = 3, verify_steps: int | None = None,
                 verify_budget: float = 900, verify_pairs: int = 1) -> Any:
    from nondet import pipeline
    from nondet.sources import Budget

    return pipeline.Options(
        seed=seed, out_dir=out_dir, ops_all=ops == "all", max_steps=max_steps, echo=verbose,
        schedule=pipeline.default_schedule() if schedule == "auto" else schedule,
        apply=tuple(apply), verify=verify,
        budget=Budget(max_fixes=max_fixes, steps=verify_steps, seconds=verify_budget,
                      pairs=verify_pairs))


def check_html_file(path: Path | None) -> None:
    """Refuse ``--html`` before anything runs: a file that cannot be written, or no Jinja2
    (the extra ``html``)."""
    if path is None:
        return
    from nondet.report import html

    check_output_file(path, "--html")
    html.require_extra()


def write_html(path: Path | None, report: Any, root: Path | None) -> None:
    """The HTML report; source files around the finding are read only inside ``root``."""
    if path is None:
        return
    from nondet.report import html

    write_output("--html", path, lambda: html.write(report, path, root=root))


def source_root(target: Target) -> Path:
    """Where the HTML report may read the script's source lines: the script's directory
    (the current one for ``-m MODULE``)."""
    base = Path(target.script).parent if target.script else Path()
    return base.resolve()
