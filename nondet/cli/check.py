"""``nondet check``: the determinism gate for CI (quiet, one summary line, JUnit, JSON)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from nondet.cli._common import App
from nondet.cli._options import make_options, make_target, target_options
from nondet.errors import NondetError
from nondet.exitcodes import EPILOG, ExitCode


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog=EPILOG,
)
@target_options
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a JUnit XML report (one test case) to this file.")
@click.option("--baseline", "baseline_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Compare one run with this stored step-level capture (half the cost of "
                   "two runs).")
@click.option("--update-baseline", is_flag=True,
              help="Run once and write the --baseline file (small; safe to commit).")
@click.option("--allow-env-drift", is_flag=True,
              help="Compare with a baseline made in a different environment anyway; the "
                   "finding is then labelled as possibly caused by that drift.")
@click.option("-v", "--verbose", is_flag=True,
              help="Progress, the script's own output and the full report.")
@click.pass_obj
def check(app: App, *, module: str | None, seed: int, out_dir: Path, json_path: Path | None,
          ops: str, max_steps: int | None, runs: int, schedule: str, junit_path: Path | None,
          baseline_path: Path | None, update_baseline: bool, allow_env_drift: bool,
          verbose: bool, script_and_args: tuple[str, ...]) -> int:
    """Check that SCRIPT is deterministic: exit 0 if its runs are bitwise identical, 1 if not.

    Quiet by default: one summary line (and GitHub Actions annotations on the script's line
    when GITHUB_ACTIONS=true). With --baseline, the script runs once and is compared with a
    capture written earlier by --update-baseline.
    """
    from nondet import pipeline
    from nondet.progress import Progress
    from nondet.report import Report, github, json_file, junit, text

    if update_baseline and baseline_path is None:
        raise click.UsageError("--update-baseline needs --baseline FILE: where to write it")
    target = make_target(module, script_and_args)
    options = make_options(seed=seed, out_dir=out_dir, ops=ops, max_steps=max_steps,
                           schedule=schedule, verbose=verbose)
    name = target.describe()
    started = time.monotonic()
    try:
        with Progress(app.err, quiet=not verbose) as progress:
            if update_baseline:
                assert baseline_path is not None
                steps, size = pipeline.write_baseline(target, options, progress, baseline_path)
                app.out.print(f"nondet check: baseline written to {baseline_path} ({steps} "
                              f"steps, {size / 1024:.1f} KiB)", highlight=False, markup=False)
                return int(ExitCode.DETERMINISTIC)
            if baseline_path is not None:
                report = pipeline.against_baseline(target, options, progress, baseline_path,
                                                   allow_env_drift)
            elif runs > 2:
                report = pipeline.repeat(target, options, progress, runs)
            else:
                report = pipeline.diagnose(target, options, progress)
    except NondetError as exc:
        elapsed = time.monotonic() - started
        failed = Report(verdict="error", exit_code=exc.exit_code, runs=[], command=name,
                        notes=[str(exc)])
        if junit_path is not None:
            junit.write(failed, junit_path, name, elapsed, error=str(exc))
        if json_path is not None:
            json_file.write(failed, json_path)
        raise
    elapsed = time.monotonic() - started
    if json_path is not None:
        json_file.write(report, json_path)
    if junit_path is not None:
        junit.write(report, junit_path, name, elapsed)
    if github.enabled():
        drift = ([f"compared across environment drift: {d['key']}" for d in
                  report.environment_drift])
        for line in github.workflow_commands(report, drift):
            app.out.print(text.printable(line), highlight=False, markup=False)
    verdict = "PASS" if report.first_divergence is None else "FAIL"
    summary = text.printable(f"{name}: {junit.summary_line(report)}")
    app.out.print(f"nondet check: {verdict} — {summary}", highlight=False, markup=False)
    if verbose:
        app.out.print()
        text.render(report, app.out)
    return int(report.exit_code)
