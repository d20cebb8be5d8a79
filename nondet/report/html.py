"""The HTML report (``--html PATH``, ``nondet report ... --html PATH``): one self-contained
file, no network, no scripts, no external fonts, so it opens from a CI artifact.

Made from the JSON report (``html_model``), so a report saved with ``--json`` renders the
same page later. Jinja2 is the optional extra ``html``; every value the template places is
autoescaped, and a Content-Security-Policy forbids scripts in case something slipped through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nondet import __version__
from nondet.errors import NondetError
from nondet.report import Report, html_model

MISSING_EXTRA = ("--html needs the optional extra `html` (Jinja2): "
                 "pip install 'nondet[html]'")


def render(data: dict[str, Any], *, root: Path | None, cwd: Path | None = None) -> str:
    """The page for a JSON report; source files are read only inside ``root``."""
    try:
        import jinja2
        from markupsafe import Markup
    except ImportError:
        raise NondetError(MISSING_EXTRA) from None
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("nondet.report", "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True)
    view = html_model.build(data, root=root, cwd=cwd)
    page: str = env.get_template("report.html.j2").render(
        view=view, version=__version__,
        # the charts are markup written by charts.py, which escapes every label itself
        growth_chart=Markup(view.growth_chart),
        fraction_chart=Markup(view.fraction_chart),
        outcome_chart=Markup(view.outcome_chart))
    return page


def require_extra() -> None:
    """Refuse ``--html`` before any run starts when the extra is missing (exit 2)."""
    try:
        import jinja2  # noqa: F401
    except ImportError:
        raise NondetError(MISSING_EXTRA) from None


def write(report: Report, path: Path, *, root: Path | None) -> None:
    write_page(render(report.to_json(), root=root), path)


def write_page(page: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
