"""Every living process's ``/proc/<pid>/stat`` fields (Linux), for walking process trees."""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def stat_fields() -> dict[int, list[str]] | None:
    """pid -> the fields of its stat line from the state letter on (field 3: ``[0]`` is the
    state, ``[1]`` the parent, ``[2]`` the process group, ``[11]``/``[12]`` user and system
    ticks), or None where ``/proc`` cannot be listed (not Linux)."""
    try:
        entries = [e for e in os.listdir(_PROC) if e.isdigit()]
    except OSError:
        return None
    stats: dict[int, list[str]] = {}
    for entry in entries:
        try:
            text = (_PROC / entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # the command name (field 2) may hold spaces and parentheses: split after its end
        stats[int(entry)] = text[text.rfind(")") + 2:].split()
    return stats
