"""``nondet run``: run a script twice under identical seeds and report the first difference."""

from __future__ import annotations

import time
from pathlib import Path

import click

from nondet.cli._common import App
from nondet.cli._options import (
    check_distinct,
    check_html_file,
    check_output_file,
    invocation,
    make_options,
    make_target,
    source_root,
    target_command,
    verify_options,
    write_html,
    write_output,
)
from nondet.cli.failure import write_failure


@target_command()
@click.option("--no-verify", is_flag=True,
              help="Do not re-run with the suggested fixes applied to verify them.")
@verify_options
@click.option("-q", "--quiet", is_flag=True, help="Only the report, no progress.")
@click.option("-v", "--verbose", is_flag=True, help="Also show the script's own output.")
@click.pass_obj
def run(app: App, *, module: str | None, seed: int, out_dir: Path, json_path: Path | None,
        html_path: Path | None, ops: str, max_steps: int | None, runs: int, schedule: str,
        apply: tuple[str, ...],
        no_verify: bool, max_fixes: int, verify_steps: int | None, verify_budget: float,
        verify_pairs: int,
        quiet: bool, verbose: bool,
        script_and_args: tuple[str, ...]) -> int:
    """Run SCRIPT twice with the same seed and find where the runs first differ.

    Options go before the script; everything after it is passed to the script, as with
    `python`. The report names the first step, the op (or the data that entered) where the
    runs part, the module and line of the script, and the fix.
    """
    from nondet import pipeline
    from nondet.progress import Progress
    from nondet.report import json_file, text

    started = time.monotonic()
    try:
        target = make_target(module, script_and_args)
        _note_own_options_after_script(app, target.args, json_path, html_path)
        check_output_file(json_path, "--json")
        check_html_file(html_path)
        check_distinct({"--json": json_path, "--html": html_path})
        with invocation(out_dir) as own_dir:
            options = make_options(seed=seed, out_dir=own_dir, ops=ops, max_steps=max_steps,
                                   schedule=schedule, verbose=verbose, apply=apply,
                                   verify=not no_verify and not apply, max_fixes=max_fixes,
                                   verify_steps=verify_steps, verify_budget=verify_budget,
                                   verify_pairs=verify_pairs)
            with Progress(app.err, quiet=quiet) as progress:
                if runs > 2:
                    report = pipeline.repeat(target, options, progress, runs)
                else:
                    report = pipeline.diagnose(target, options, progress)
    except BaseException as exc:  # no verdict: --json still says why (as check's does)
        write_failure(exc, "nondet run", time.monotonic() - started, None, json_path)
        raise
    text.render(report, app.out)  # the report first: a --json that cannot be written is
    if json_path is not None:     # then an error below it, not instead of it
        write_output("--json", json_path, lambda: json_file.write(report, json_path))
    write_html(html_path, report, source_root(target))
    return int(report.exit_code)


def _note_own_options_after_script(app: App, args: tuple[str, ...], json_path: Path | None,
                                   html_path: Path | None) -> None:
    """``nondet run train.py --json r.json`` hands ``--json`` to the script, as ``python``
    would; a script that ignores arguments it does not know then leaves no report and no
    word (trial round 18). One line says so, where nondet's own option was not given."""
    for option, given in (("--json", json_path), ("--html", html_path)):
        if given is None and any(a == option or a.startswith(option + "=") for a in args):
            app.err.print(f"nondet: note: {option} after the script is the script's argument; "
                          f"for nondet's report, put {option} before the script",
                          highlight=False, markup=False)
