"""``nondet run``: run a script twice under identical seeds and report the first difference."""

from __future__ import annotations

from pathlib import Path

import click

from nondet.cli._common import App
from nondet.exitcodes import EPILOG
from nondet.launch import Target


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog=EPILOG,
)
@click.option("-m", "module", metavar="MODULE",
              help="Run a module as with `python -m MODULE` (instead of a script path).")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed for random, NumPy, the framework and PYTHONHASHSEED in both runs.")
@click.option("--out", "out_dir", default=".nondet", show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Where the capture files (.h5) and the runs' output logs go.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the report as JSON to this file.")
@click.option("--ops", type=click.Choice(["auto", "all"]), default="auto", show_default=True,
              help="Op-level capture: `auto` for init and step 0 then only where the runs "
                   "differ (re-runs); `all` for every step (rare nondeterminism).")
@click.option("--max-steps", type=click.IntRange(min=1), metavar="N",
              help="Stop each run after N training steps.")
@click.option("--schedule", type=click.Choice(["auto", "lockstep", "sequential"]),
              default="auto", show_default=True,
              help="How the two runs share the machine: `lockstep` runs both at once, taking "
                   "turns step by step (both stop early when they differ); `sequential` runs "
                   "one after the other (half the memory: the default on GPU machines).")
@click.option("-q", "--quiet", is_flag=True, help="Only the report, no progress.")
@click.option("-v", "--verbose", is_flag=True, help="Also show the script's own output.")
@click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
@click.pass_obj
def run(app: App, *, module: str | None, seed: int, out_dir: Path, json_path: Path | None,
        ops: str, max_steps: int | None, schedule: str, quiet: bool, verbose: bool,
        script_and_args: tuple[str, ...]) -> int:
    """Run SCRIPT twice with the same seed and find where the runs first differ.

    Options go before the script; everything after it is passed to the script, as with
    `python`. The report names the first step, the op (or the data that entered) where the
    runs part, the module and line of the script, and the fix.
    """
    from nondet import pipeline
    from nondet.progress import Progress
    from nondet.report import json_file, text

    target = _target(module, script_and_args)
    options = pipeline.Options(
        seed=seed, out_dir=out_dir, ops_all=ops == "all", max_steps=max_steps, echo=verbose,
        schedule=pipeline.default_schedule() if schedule == "auto" else schedule)
    with Progress(app.err, quiet=quiet) as progress:
        report = pipeline.diagnose(target, options, progress)
    if json_path is not None:
        json_file.write(report, json_path)
    text.render(report, app.out)
    return int(report.exit_code)


def _target(module: str | None, script_and_args: tuple[str, ...]) -> Target:

    if module:
        return Target(script=None, module=module, args=tuple(script_and_args))
    if not script_and_args:
        raise click.UsageError("missing SCRIPT (or -m MODULE): what should nondet run?")
    script, *args = script_and_args
    return Target(script=script, module=None, args=tuple(args))
