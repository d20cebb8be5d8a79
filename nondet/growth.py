"""How a difference grows across steps: one ``GrowthRow`` per step both runs recorded.

Only what the captures hold is reported. Every step row has the loss, the parameters' float64
sum and one fingerprint per part of the state; steps with op-level capture ("detailed") also
have, per tensor, a fingerprint, float64 sum, largest magnitude and size. Equal fingerprints
mean equal bits, so the difference is exactly 0; when they differ, the exact largest |a-b| and
fraction of differing elements are unknown (nondet keeps no copy of the state), and only
bounds follow from the per-tensor statistics:

- |a-b| somewhere in a tensor is at least ||a|max - |b|max| and at least |sum a - sum b| / size;
- at most the elements of the tensors whose fingerprints differ differ.
"""

from __future__ import annotations

import math

import numpy as np

from nondet import compare
from nondet.records import STEP_COMPONENTS, Group
from nondet.report import GrowthRow, StateDiff
from nondet.store import Capture

#: Steps shown after the first difference, and before it (identical, for the chart's scale).
AFTER = 500
BEFORE = 10

_FIELD_LABELS = {name: name.removesuffix("_fp") for name, _ in STEP_COMPONENTS}
_PARTS = (("params", "params_fp", Group.PARAM), ("grads", "grads_fp", Group.GRAD),
          ("optimizer", "optim_fp", Group.OPTIM))


def growth(a: Capture, b: Capture, first: int) -> list[GrowthRow]:
    """The steps both runs have, from a few before ``first`` (the first step whose state
    differs) to ``AFTER`` after it."""
    rows_a = {int(r["step"]): r for r in a.steps}
    rows_b = {int(r["step"]): r for r in b.steps}
    common = [s for s in sorted(set(rows_a) & set(rows_b)) if s >= 0]
    before = [s for s in common if s < first][-BEFORE:]
    steps = before + [s for s in common if s >= first][:AFTER]
    out = []
    for s in steps:
        ra, rb = rows_a[s], rows_b[s]
        parts = {name: _state_diff(ra, rb, fp_field, _named(a, s, group), _named(b, s, group))
                 for name, fp_field, group in _PARTS}
        params_sum_a, params_sum_b = float(ra["params_sum"]), float(rb["params_sum"])
        if parts["params"].differs and math.isfinite(params_sum_a - params_sum_b):
            parts["params"].sum_abs_diff = abs(params_sum_a - params_sum_b)
        out.append(GrowthRow(
            step=s, loss_a=float(ra["loss"]), loss_b=float(rb["loss"]),
            differing=[_FIELD_LABELS[f] for f in compare.rows_differ(ra, rb)],
            params_sum_a=params_sum_a, params_sum_b=params_sum_b,
            params=parts["params"], grads=parts["grads"], optimizer=parts["optimizer"]))
    return out


def _named(capture: Capture, step: int, group: Group) -> list[tuple[str, np.void]]:
    """A step's per-tensor rows of one group with their names (string ids belong to each
    capture's own table, so runs are matched on the names)."""
    rows = capture.tensor_rows(step)
    return [(capture.string(int(r["name"])), r) for r in rows[rows["group"] == int(group)]]


def _state_diff(ra: np.void, rb: np.void, fp_field: str, tensors_a: list[tuple[str, np.void]],
                tensors_b: list[tuple[str, np.void]]) -> StateDiff:
    fa, fb = int(ra[fp_field]), int(rb[fp_field])
    if fa == 0 and fb == 0:
        return StateDiff()  # not recorded in this step (e.g. traced TensorFlow gradients)
    if fa == fb:
        return StateDiff(differs=False, max_abs_diff=0.0, frac_differ=0.0, sum_abs_diff=0.0,
                         max_abs_diff_min=0.0, frac_differ_max=0.0)
    diff = StateDiff(differs=True)
    if tensors_a and [n for n, _ in tensors_a] == [n for n, _ in tensors_b]:
        _bounds(diff, [r for _, r in tensors_a], [r for _, r in tensors_b])
    return diff


def _bounds(diff: StateDiff, rows_a: list[np.void], rows_b: list[np.void]) -> None:
    """Fill the bounds from the per-tensor rows of both runs (the same names in the same
    order); sizes that disagree leave the bounds unknown."""
    if any(int(x["numel"]) != int(y["numel"]) for x, y in zip(rows_a, rows_b, strict=True)):
        return
    total = sum(int(x["numel"]) for x in rows_a)
    differing = [(x, y) for x, y in zip(rows_a, rows_b, strict=True)
                 if int(x["fp"]) != int(y["fp"])]
    diff.tensors, diff.tensors_differ = len(rows_a), len(differing)
    if total:
        diff.frac_differ_max = sum(int(x["numel"]) for x, _ in differing) / total
    lower = 0.0
    for x, y in differing:
        n = int(x["numel"])
        by_max = abs(float(x["maxabs"]) - float(y["maxabs"]))
        by_sum = abs(float(x["sum"]) - float(y["sum"])) / n if n else math.nan
        for bound in (by_max, by_sum):
            if math.isfinite(bound):
                lower = max(lower, bound)
    diff.max_abs_diff_min = lower or None  # "at least 0" says nothing
    sums = [(float(x["sum"]), float(y["sum"])) for x, y in zip(rows_a, rows_b, strict=True)]
    gap = abs(sum(s for s, _ in sums) - sum(s for _, s in sums))
    diff.sum_abs_diff = gap if math.isfinite(gap) else None
