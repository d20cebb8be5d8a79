"""GitHub Actions workflow commands: an annotation on the user's source line."""

from __future__ import annotations

import os
from collections.abc import Sequence

from nondet.report import Report
from nondet.report.junit import summary_line


def enabled() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def workflow_commands(report: Report, warnings: Sequence[str] = ()) -> list[str]:
    """``::error``/``::warning`` lines for the job log (printed to stdout)."""
    lines = [f"::warning title=nondet::{_data(w)}" for w in warnings]
    div = report.first_divergence
    if div is None:
        return lines
    where = ""
    if div.source and ":" in div.source:
        path, _, line = div.source.rpartition(":")
        where = f"file={_property(path)},line={_property(line)},"
    lines.append(f"::error {where}title=nondet: nondeterminism::{_data(summary_line(report))}")
    return lines


def _data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")
