"""``nondet report``: the HTML page, later, from a saved JSON report or a run's captures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from nondet.cli._common import App
from nondet.cli._options import check_html_file, write_output
from nondet.errors import NondetError
from nondet.exitcodes import EPILOG
from nondet.outdir import display

#: A JSON report larger than this is not one nondet wrote (the growth block is the largest
#: part: a few hundred bytes per step).
MAX_JSON_BYTES = 64 * 1024 * 1024


@click.command(epilog=EPILOG)
@click.argument("source", metavar="JSON_OR_CAPTURES",
                type=click.Path(path_type=Path))
@click.option("--html", "html_path", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report as one self-contained HTML page to this file.")
@click.pass_obj
def report(app: App, *, source: Path, html_path: Path) -> int:
    """Make the HTML report from a JSON report (--json) or a directory of captures.

    \b
    nondet report report.json --html report.html
    nondet report .nondet/latest --html report.html

    Source lines around the finding are shown from files under the current directory.
    Exits with the report's own code (0 deterministic, 1 nondeterministic).
    """
    from nondet.report import html
    from nondet.report.text import printable

    check_html_file(html_path)
    if source.is_dir():
        data = _from_captures(source)
    elif source.is_file():
        data = _from_json(source)
    elif source.exists():  # a FIFO, a device: never opened (it could block or never end)
        raise NondetError(f"{display(source)} is not a regular file: give a JSON report "
                          "written with --json, or a directory of captures (.nondet/latest)")
    else:
        raise NondetError(f"{display(source)} does not exist: give a JSON report written with "
                          "--json, or a directory of captures (.nondet/latest)")
    page = html.render(data, root=Path.cwd())
    write_output("--html", html_path, lambda: html.write_page(page, html_path))
    verdict = printable(str(data.get("verdict")))  # from a file anyone may have written
    app.out.print(f"nondet report: {display(html_path)} written ({verdict})",
                  highlight=False, markup=False)
    code = data.get("exit_code")
    return code if code in (0, 1) else 2


#: The first bytes of every HDF5 file (a capture given where a JSON report is asked for).
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _from_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as head:
            is_capture = head.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE
    except OSError:
        is_capture = False  # said below, with the reason
    if is_capture:
        raise NondetError(f"{display(path)} is a capture, not a JSON report: give the directory "
                          f"that holds run-a.h5 and run-b.h5 ({display(path.parent)})")
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise NondetError(f"{display(path)} is too large to be a nondet JSON report")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not JSON"
        raise NondetError(f"cannot read {display(path)} as a JSON report ({reason}): give a "
                          "file written by --json, or a directory of captures") from None
    if not isinstance(data, dict) or data.get("nondet_report_version") != 1:
        raise NondetError(f"{display(path)} is not a nondet JSON report (no "
                          "nondet_report_version 1): give a file written by --json")
    return data


def _from_captures(folder: Path) -> dict[str, Any]:
    """The report of run a and run b in an invocation directory (or ``--out``'s latest)."""
    from nondet import analysis
    from nondet.store import open_capture

    if not (folder / "run-a.h5").is_file() and (folder / "latest" / "run-a.h5").is_file():
        folder = folder / "latest"
    paths = [folder / "run-a.h5", folder / "run-b.h5"]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise NondetError(f"no {missing[0].name} in {display(folder)}: give the directory of "
                          "one nondet run (.nondet/latest) or a JSON report written by --json")
    a, b = (open_capture(p) for p in paths)
    a.verify()  # damage anywhere is exit 2, never a verdict
    b.verify()
    found = analysis.compare_captures(a, b, command=f"report {folder}", suggest=True)
    return found.to_json()
