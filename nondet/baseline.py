"""Baselines: a small step-level capture, committed to the repository, that later runs of the
same script are compared with (one run instead of two).

A baseline holds the step rows (fingerprints of data, loss, gradients, parameters, buffers,
optimizer state and RNG states per step) and the environment: kilobytes for a short check,
no tensor values, nothing secret beyond the script's path and the machine's description.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from nondet.environment import INFORMATIONAL, differences
from nondet.errors import NondetError
from nondet.store import Capture, open_capture

#: Environment keys that describe a run without changing its numbers.
NOT_DRIFT = (*INFORMATIONAL, "platform", "cpu_count")


def load(path: Path) -> Capture:
    if not path.exists():
        raise NondetError(f"baseline not found: {path}; write it with "
                          f"`nondet check --update-baseline --baseline {path} SCRIPT`")
    return open_capture(path)


def save(capture_path: Path, destination: Path) -> int:
    """Store a finished run's capture as the baseline; returns its size in bytes."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(capture_path, destination)
    return destination.stat().st_size


def drift(baseline: Capture, current: Capture) -> list[dict[str, str]]:
    """Environment differences that void a bitwise comparison (versions, devices, thread
    counts, determinism switches and variables)."""
    return [d for d in differences(baseline.env, current.env) if d["key"] not in NOT_DRIFT]


def describe_drift(items: list[dict[str, str]]) -> str:
    return ", ".join(f"{d['key']} (baseline {d['a']}, now {d['b']})" for d in items)
