"""The JSON report file (contract: docs/report.md)."""

from __future__ import annotations

import json
from pathlib import Path

from nondet.report import Report


def write(report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
