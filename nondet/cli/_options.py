"""Options shared by ``nondet run`` and ``nondet check`` (the target and how to run it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from nondet.launch import Target

F = Callable[..., Any]


def target_options(command: F) -> F:
    """-m, --seed, --out, --json, --ops, --max-steps, --runs, --schedule and SCRIPT ARGS."""
    for option in reversed([
        click.option("-m", "module", metavar="MODULE",
                     help="Run a module as with `python -m MODULE` (instead of a script path)."),
        click.option("--seed", default=0, show_default=True, type=int,
                     help="Seed for random, NumPy, the framework and PYTHONHASHSEED in every "
                          "run."),
        click.option("--out", "out_dir", default=".nondet", show_default=True,
                     type=click.Path(file_okay=False, path_type=Path),
                     help="Where the capture files (.h5) and the runs' output logs go."),
        click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
                     help="Also write the report as JSON to this file."),
        click.option("--ops", type=click.Choice(["auto", "all"]), default="auto",
                     show_default=True,
                     help="Op-level capture: `auto` for init and step 0, then only where the "
                          "runs differ (re-runs); `all` for every step (rare nondeterminism)."),
        click.option("--max-steps", type=click.IntRange(min=1), metavar="N",
                     help="Stop each run after N training steps."),
        click.option("--runs", type=click.IntRange(min=2), default=2, show_default=True,
                     metavar="N",
                     help="Run N times (one after the other), show how each ended and how many "
                          "distinct outcomes there were, and explain the first run that "
                          "differs from the first."),
        click.option("--schedule", type=click.Choice(["auto", "lockstep", "sequential"]),
                     default="auto", show_default=True,
                     help="How two runs share the machine: `lockstep` runs both at once, "
                          "taking turns step by step (both stop early when they differ); "
                          "`sequential` runs one after the other (half the memory: the default "
                          "on GPU machines)."),
        click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED,
                       metavar="SCRIPT [ARGS]..."),
    ]):
        command = option(command)
    return command


def make_target(module: str | None, script_and_args: tuple[str, ...]) -> Target:
    if module:
        return Target(script=None, module=module, args=tuple(script_and_args))
    if not script_and_args:
        raise click.UsageError("missing SCRIPT (or -m MODULE): what should nondet run?")
    script, *args = script_and_args
    return Target(script=script, module=None, args=tuple(args))


def make_options(*, seed: int, out_dir: Path, ops: str, max_steps: int | None, schedule: str,
                 verbose: bool) -> Any:
    from nondet import pipeline

    return pipeline.Options(
        seed=seed, out_dir=out_dir, ops_all=ops == "all", max_steps=max_steps, echo=verbose,
        schedule=pipeline.default_schedule() if schedule == "auto" else schedule)
