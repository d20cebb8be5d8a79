"""``nondet check``: the determinism gate for CI (quiet, one summary line, JUnit, JSON)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from nondet.cli._common import App
from nondet.cli._options import (
    TargetCommand,
    check_distinct,
    check_html_file,
    check_output_file,
    invocation,
    make_options,
    make_target,
    require_utf8,
    source_root,
    target_command,
    verify_options,
    write_html,
    write_output,
)
from nondet.cli.failure import write_failure
from nondet.exitcodes import ExitCode
from nondet.outdir import display


class CheckCommand(TargetCommand):
    """Even a command line that does not parse (a bad --seed, an unknown option) leaves the
    JUnit and JSON files it names, so CI shows the error rather than a missing report."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        raw = list(args)  # the parser consumes ``args``
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            junit_path, json_path = _raw_value(raw, "--junit"), _raw_value(raw, "--json")
            write_failure(exc, "nondet check", 0.0,
                           Path(junit_path) if junit_path else None,
                           Path(json_path) if json_path else None)
            raise


def _raw_value(args: list[str], option: str) -> str | None:
    """The value of ``option`` among the arguments before the script (or None)."""
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == option and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


@target_command(CheckCommand)
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
@click.option("--allow-script-change", is_flag=True,
              help="Compare with a baseline made from a different script (another version "
                   "of it, or other script arguments) anyway.")
@click.option("--verify-fix", is_flag=True,
              help="When the runs differ, re-run with the suggested fixes applied to verify "
                   "them (as `nondet run` does).")
@verify_options
@click.option("-v", "--verbose", is_flag=True,
              help="Progress, the script's own output and the full report.")
@click.pass_obj
def check(app: App, *, module: str | None, seed: int, out_dir: Path, json_path: Path | None,
          html_path: Path | None, ops: str, max_steps: int | None, runs: int, schedule: str,
          apply: tuple[str, ...],
          verify_fix: bool, max_fixes: int, verify_steps: int | None, verify_budget: float,
          verify_pairs: int,
          junit_path: Path | None,
          baseline_path: Path | None, update_baseline: bool, allow_env_drift: bool,
          allow_script_change: bool, verbose: bool, script_and_args: tuple[str, ...]) -> int:
    """Check that SCRIPT is deterministic: exit 0 if its runs are bitwise identical, 1 if not.

    Quiet by default: one summary line (and GitHub Actions annotations on the script's line
    when GITHUB_ACTIONS=true). With --baseline, the script runs once and is compared with a
    capture written earlier by --update-baseline.
    """
    from nondet import pipeline
    from nondet.progress import Progress
    from nondet.report import github, json_file, junit, text

    name = " ".join(display(a) for a in ((f"-m {module}",) if module else ())
                    + script_and_args) or "(no script)"
    started = time.monotonic()
    try:
        if update_baseline and baseline_path is None:
            raise click.UsageError("--update-baseline needs --baseline FILE: where to write it")
        target = make_target(module, script_and_args)
        name = display(target.describe())
        check_output_file(json_path, "--json")
        check_output_file(junit_path, "--junit")
        check_html_file(html_path)
        check_distinct({"--json": json_path, "--junit": junit_path, "--html": html_path,
                        "--baseline": baseline_path})
        if update_baseline:
            check_output_file(baseline_path, "--baseline")
        elif baseline_path is not None:
            require_utf8("--baseline", baseline_path)
        with invocation(out_dir) as own_dir:
            options = make_options(seed=seed, out_dir=own_dir, ops=ops, max_steps=max_steps,
                                   schedule=schedule, verbose=verbose,
                                   apply=apply, verify=verify_fix and not apply,
                                   max_fixes=max_fixes, verify_steps=verify_steps,
                                   verify_budget=verify_budget,
                                   verify_pairs=verify_pairs)
            with Progress(app.err, quiet=not verbose) as progress:
                if update_baseline:
                    assert baseline_path is not None
                    steps, size = pipeline.write_baseline(target, options, progress,
                                                          baseline_path)
                    app.out.print(f"nondet check: baseline written to {display(baseline_path)} "
                                  f"({steps} steps, {size / 1024:.1f} KiB)", highlight=False,
                                  markup=False)
                    return int(ExitCode.DETERMINISTIC)
                if baseline_path is not None:
                    report = pipeline.against_baseline(target, options, progress,
                                                       baseline_path, allow_env_drift,
                                                       allow_script_change)
                elif runs > 2:
                    report = pipeline.repeat(target, options, progress, runs)
                else:
                    report = pipeline.diagnose(target, options, progress)
    except BaseException as exc:
        write_failure(exc, name, time.monotonic() - started, junit_path, json_path)
        raise
    elapsed = time.monotonic() - started
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
    # The verdict is printed first: a report file that cannot be written is an error after it.
    if json_path is not None:
        write_output("--json", json_path, lambda: json_file.write(report, json_path))
    if junit_path is not None:
        write_output("--junit", junit_path,
                     lambda: junit.write(report, junit_path, name, elapsed))
    write_html(html_path, report, source_root(target))
    return int(report.exit_code)


