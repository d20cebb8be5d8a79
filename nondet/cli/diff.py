"""``nondet diff``: compare two captures made anywhere (machines, versions, branches)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from nondet.cli._common import App
from nondet.cli._options import (
    check_distinct,
    check_html_file,
    check_output_file,
    write_html,
    write_output,
)
from nondet.errors import NondetError
from nondet.exitcodes import EPILOG


@click.command(epilog=EPILOG)
@click.argument("capture_a", type=click.Path(path_type=Path))
@click.argument("capture_b", type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the report as JSON to this file.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the report as one self-contained HTML page (needs the extra "
                   "`html`); source lines are shown from files under the current directory.")
@click.pass_obj
def diff(app: App, *, capture_a: Path, capture_b: Path, json_path: Path | None,
         html_path: Path | None) -> int:
    """Compare two captures: environment differences first, then the first divergence.

    Two run directories of a torchrun job (run-a/, run-b/ with rank<R>.h5) are compared
    rank by rank."""
    from nondet import analysis
    from nondet.report import json_file, text
    from nondet.store import open_capture

    check_html_file(html_path)
    check_output_file(json_path, "--json")
    check_distinct({"--json": json_path, "--html": html_path})
    if capture_a.is_dir() or capture_b.is_dir():
        if not (capture_a.is_dir() and capture_b.is_dir()):
            raise click.UsageError("give two capture files or two run directories, not one "
                                   "of each")
        _refuse_same(capture_a, capture_b, "directory")
        from nondet import jobs

        report = jobs.diff_dirs(capture_a, capture_b)
        if json_path is not None:
            write_output("--json", json_path, lambda: json_file.write(report, json_path))
        text.render(report, app.out)
        write_html(html_path, report, Path.cwd())
        return int(report.exit_code)
    a, b = open_capture(capture_a), open_capture(capture_b)
    a.verify()  # damage anywhere is exit 2, never a verdict (checksums checked as read)
    b.verify()
    _refuse_same(capture_a, capture_b, "file")
    notes: list[str] = []
    if a.attrs.get("script_sha256") != b.attrs.get("script_sha256"):
        what = (f"{a.attrs.get('script') or a.attrs.get('module')} vs "
                f"{b.attrs.get('script') or b.attrs.get('module')}")
        message = (f"the captures are of different scripts or script versions ({what}): "
                   "differences may come from the code, not from nondeterminism")
        notes.append(message)
        app.err.print(f"nondet: warning: {text.printable(message)}", highlight=False,
                      markup=False)
    report = analysis.compare_captures(a, b, command=f"diff {capture_a} {capture_b}",
                                       notes=notes, suggest=True)
    if json_path is not None:
        write_output("--json", json_path, lambda: json_file.write(report, json_path))
    text.render(report, app.out)
    write_html(html_path, report, Path.cwd())
    return int(report.exit_code)


def _refuse_same(a: Path, b: Path, what: str) -> None:
    """A capture compared with itself is always "identical": exit 0 for a typo."""
    try:
        same = os.path.samefile(a, b)
    except OSError:
        return  # a missing or unreadable file is said so when it is opened
    if same:
        raise NondetError(f"{a} and {b} are the same {what}: give the captures of two runs "
                          "(run-a.h5 and run-b.h5 of one invocation, or of two machines)")
