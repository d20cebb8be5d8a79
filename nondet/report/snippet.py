"""A few lines around the finding's source line, for the HTML report, read safely.

A location comes from a capture or a JSON report, which anyone can craft, so a file is read
only if all of these hold: it is a ``.py`` file, it resolves (symlinks followed) inside
``root`` (the script's directory for ``run``/``check``, the current directory for ``diff``
and ``report``), it is a regular file of at most 2 MB, and its line is the very text the run
captured. Anything else gives no snippet: the page then shows the captured line alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Lines shown before and after the source line.
AROUND = 3
_MAX_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class SnippetLine:
    number: int
    text: str
    focus: bool


def read(source: str, captured: str, root: Path | None, cwd: Path | None = None
         ) -> list[SnippetLine]:
    """Lines around ``source`` ("file.py:27"), or [] when it may not or cannot be read."""
    file, _, line = source.rpartition(":")
    if root is None or not captured.strip() or not line.isdigit() or not file.endswith(".py"):
        return []
    number = int(line)
    try:
        path = Path(file) if os.path.isabs(file) else (cwd or Path.cwd()) / file
        path = path.resolve(strict=True)
        if not path.is_relative_to(root.resolve(strict=True)) or not path.is_file():
            return []
        if path.stat().st_size > _MAX_BYTES:
            return []
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except (OSError, RuntimeError, ValueError):  # gone, unreadable, a symlink loop
        return []
    if not 1 <= number <= len(lines) or lines[number - 1].strip() != captured.strip():
        return []  # another version of the file, or not the file the run ran
    first, last = max(1, number - AROUND), min(len(lines), number + AROUND)
    return [SnippetLine(n, lines[n - 1], n == number) for n in range(first, last + 1)]
