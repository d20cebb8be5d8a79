"""GitHub Actions workflow commands: an annotation on the user's source line."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import PurePosixPath

from nondet.report import Report
from nondet.report.junit import summary_line
from nondet.report.text import printable


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
        path = _relative_to_workspace(path)
        if _inside_checkout(path) and line.isascii() and line.isdigit():
            where = f"file={_property(path)},line={_property(line)},"
    lines.append(f"::error {where}title=nondet: nondeterminism::{_data(summary_line(report))}")
    return lines


def _relative_to_workspace(path: str) -> str:
    """An absolute path under $GITHUB_WORKSPACE (the checkout) as the relative path GitHub
    wants; anything else is returned as it is (and then refused if absolute)."""
    workspace = os.environ.get("GITHUB_WORKSPACE", "")
    if not (workspace and os.path.isabs(path) and os.path.isabs(workspace)):
        return path
    rel = os.path.relpath(os.path.normpath(path), os.path.normpath(workspace))
    return path if rel.startswith("..") else rel


def _inside_checkout(path: str) -> bool:
    """Annotate only a relative path that stays inside the checkout: the source comes from a
    capture, and a crafted one must not point the job's annotations anywhere else."""
    if not path or not _SAFE_PATH.fullmatch(path) or "\\" in path:
        return False
    pure = PurePosixPath(path)
    return not pure.is_absolute() and ".." not in pure.parts and not path.startswith("~")


_SAFE_PATH = re.compile(r"[^\x00-\x1f\x7f-\x9f]+")


def _data(text: str) -> str:
    text = printable(text, newlines=True)
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")
