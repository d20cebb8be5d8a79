"""The table of ``--runs N``: how each run ended, as a letter per distinct outcome.

A run's outcome is its final weights' digest, its number of training steps and its last
loss (bitwise). A torchrun job's outcome is that of every rank together: jobs get the same
letter only if every rank ended identically; its row shows rank 0's steps and loss and a
digest of all ranks' digests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from nondet.fingerprint import combine
from nondet.report import RepeatRow
from nondet.runspec import RunResult
from nondet.store import Capture

#: (final weights' digest, training steps, last loss) of one run (one rank).
Outcome = tuple[int, int, float]


def outcome(result: RunResult, capture: Capture) -> Outcome:
    steps = capture.steps[capture.steps["step"] >= 0]
    digest = int(result.final.get("final_params_fp")
                 or (int(steps["params_fp"][-1]) if len(steps) else 0))
    loss = float(steps["loss"][-1]) if len(steps) else math.nan
    return digest, len(steps), loss


def rows(labels: Sequence[str], statuses: Sequence[str],
         outcomes: Sequence[Sequence[Outcome]]) -> list[RepeatRow]:
    """One row per run; ``outcomes[i]`` holds run i's outcome per rank (one for a process)."""
    letters: dict[tuple[tuple[int, int, int], ...], str] = {}
    table = []
    for label, status, parts in zip(labels, statuses, outcomes, strict=True):
        key = tuple((d, n, int(np.float64(loss).view(np.uint64))) for d, n, loss in parts)
        letter = letters.setdefault(key, chr(ord("A") + len(letters) % 26))
        digest, steps, loss = parts[0]
        if len(parts) > 1:
            digest = combine(d for d, _, _ in parts)
        table.append(RepeatRow(label=label, steps=steps, final_loss=loss, digest=digest,
                               outcome=letter, status=status))
    return table
