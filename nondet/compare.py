"""Comparing two captures: the first diverging step, then the first injection point.

Pure functions over the arrays of two captures; no I/O, no frameworks. The rule
(docs/architecture.md, "The injection rule"): walk the op records of the diverging step(s)
in execution order; the first
record whose output differs while all its inputs matched created the difference (an
*injection point*); a differing tensor that was not produced by a recorded op is an *entry
point*; a differing op name at the same position is a *structure* mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nondet.records import INIT_STEP, STEP_COMPONENTS, Flag, Kind, Phase, split_node


@dataclass(frozen=True)
class StepDivergence:
    step: int  # -1: the state when training starts already differs
    phase: Phase
    fields: tuple[str, ...]  # step-row fields that differ, e.g. ("grads_fp", "params_fp")
    structural: bool = False  # one run has steps the other does not


def rows_differ(a: np.void, b: np.void) -> tuple[str, ...]:
    """Step-row fields (fingerprints) that differ, in attribution order."""
    return tuple(name for name, _ in STEP_COMPONENTS if int(a[name]) != int(b[name]))


#: Step-row fields that make up the training state: the verdict follows these.
TRAINING_STATE = ("data_fp", "loss_fp", "grads_fp", "params_fp", "buffers_fp", "optim_fp")
#: What training computed and kept: a difference in the data that entered counts only
#: where one of these differs too (``training_differs``).
TRAINED = TRAINING_STATE[1:]


def training_differs(a: np.void, b: np.void) -> bool:
    """Whether two step rows differ in the training state (not only in RNG state or probes,
    which no verdict follows).

    Data that entered with different values counts only when the rows carry training
    fingerprints (loss, gradients, parameters, buffers, optimizer state) and one of them
    differs, or when they carry none (a step nondet sees only its data of): a value made
    from the clock and handed to torch (``torch.tensor(32 / elapsed)``, Lightning's
    ``self.log(name, seconds)``) enters in every step with a new value and reaches
    nothing that trains. Data that does reach training (a batch, a replay buffer read
    steps later) changes the loss, the gradients or the parameters in the step it is
    used in."""
    if any(int(a[name]) != int(b[name]) for name in TRAINED):
        return True
    if int(a["data_fp"]) == int(b["data_fp"]):
        return False
    return not any(int(a[name]) or int(b[name]) for name in TRAINED)


def state_only(differing: tuple[str, ...]) -> bool:
    """The step-row fields that differ are outside the training state (RNG state, probes):
    changed by no op of that step the rows count, it is read by the step after."""
    return bool(differing) and not set(differing) & set(TRAINING_STATE)


def data_only(a: np.void, b: np.void, differing: tuple[str, ...]) -> bool:
    """The rows differ in their data alone, and that difference reached no training state
    (``training_differs``)."""
    return differing == ("data_fp",) and not training_differs(a, b)


def first_step_divergence(steps_a: np.ndarray, steps_b: np.ndarray,
                          count_extra_steps: bool = True) -> StepDivergence | None:
    """The first step whose rows differ; then, if ``count_extra_steps`` (both runs ended on
    their own), the first step only one run has. A run that was stopped or interrupted is
    compared over the steps both have. A step whose rows differ only in data that reached
    no training state (``training_differs``: a clock reading handed to torch) is passed
    over for a later one that differs in more; failing any, the first such step is the
    divergence (the verdict then follows the training state: a note)."""
    by_step_a = {int(r["step"]): r for r in steps_a}
    by_step_b = {int(r["step"]): r for r in steps_b}
    passed_over: StepDivergence | None = None
    for step in sorted(set(by_step_a) & set(by_step_b)):
        row_a, row_b = by_step_a[step], by_step_b[step]
        differing = rows_differ(row_a, row_b)
        if differing:
            phase = Phase.INIT if step == INIT_STEP else dict(STEP_COMPONENTS)[differing[0]]
            found = StepDivergence(step, phase, differing)
            if not data_only(row_a, row_b, differing):
                return found
            passed_over = passed_over or found
    only = sorted(set(by_step_a) ^ set(by_step_b))
    if only and count_extra_steps:
        return StepDivergence(only[0], Phase.OTHER, (), structural=True)
    return passed_over


#: Steps compared after one whose data alone differed, all with the same training state,
#: that show the data did not reach training (``data_unsettled``).
CONTAINED_AFTER = 3


def data_unsettled(steps_a: np.ndarray, steps_b: np.ndarray,
                   count_extra_steps: bool = True) -> bool:
    """Rows part only in data that reached no training state, yet the comparison cannot
    tell that it never would: the runs did not both end on their own (``count_extra_steps``
    False: stopped, interrupted, a baseline of a few steps) and no such step was followed
    by ``CONTAINED_AFTER`` compared steps (a replay buffer's entry read a few steps later,
    past where the captures end). Such a difference then counts as one in training."""
    by_step_a = {int(r["step"]): r for r in steps_a}
    by_step_b = {int(r["step"]): r for r in steps_b}
    common = sorted(set(by_step_a) & set(by_step_b))
    if count_extra_steps or any(training_differs(by_step_a[s], by_step_b[s]) for s in common):
        return False
    data_steps = [i for i, s in enumerate(common)
                  if int(by_step_a[s]["data_fp"]) != int(by_step_b[s]["data_fp"])]
    return bool(data_steps) and len(common) - 1 - data_steps[0] < CONTAINED_AFTER


def parted(steps_a: np.ndarray, steps_b: np.ndarray,
           count_extra_steps: bool = True) -> StepDivergence | None:
    """Where two runs part for good: ``first_step_divergence``, except data that reached
    no training state (a clock reading handed to torch), which is no parting unless the
    comparison cannot tell (``data_unsettled``). What fix verification, the narrowing
    re-runs and ``--runs`` ask: do these runs repeat?"""
    div = first_step_divergence(steps_a, steps_b, count_extra_steps)
    if div is None or div.structural:
        return div
    by_step_a = {int(r["step"]): r for r in steps_a}
    by_step_b = {int(r["step"]): r for r in steps_b}
    if not data_only(by_step_a[div.step], by_step_b[div.step], div.fields):
        return div
    return div if data_unsettled(steps_a, steps_b, count_extra_steps) else None


def parted_in_training(steps_a: np.ndarray, steps_b: np.ndarray,
                       count_extra_steps: bool = True, last: int | None = None,
                       ) -> StepDivergence | None:
    """``parted``, except runs whose rows differ only in state no verdict follows (RNG
    state, probes) while their training state repeated at every step, and for at least
    ``CONTAINED_AFTER`` steps after the first such difference or up to step ``last`` (the
    last step a fix is verified over):
    a Keras random layer's seed advanced as far as prefetching ran, and nothing that
    trains read it. What fix verification asks: with the fix, does training repeat?"""
    div = parted(steps_a, steps_b, count_extra_steps)
    if div is None or div.structural or not state_only(div.fields):
        return div
    by_step_a = {int(r["step"]): r for r in steps_a}
    by_step_b = {int(r["step"]): r for r in steps_b}
    common = sorted(set(by_step_a) & set(by_step_b))
    if any(training_differs(by_step_a[s], by_step_b[s]) for s in common):
        return div
    after = [s for s in common if s > div.step]
    reached = last is not None and bool(common) and common[-1] >= last
    return None if len(after) >= CONTAINED_AFTER or reached else div


@dataclass
class OpDivergence:
    """The first op-level finding in a window of steps."""

    kind: str  # "op" | "entry" | "structure"
    position: int  # index into the compared (concatenated) record arrays
    row_a: np.void | None
    row_b: np.void | None
    explained: bool = True  # False: output differs, inputs differ, but no earlier record does
    reads_uninitialized: bool = False
    scalar_argument: bool = False  # the op's tensors matched but a Python number differed
    context: list[tuple[int, str]] = field(default_factory=list)  # (position, state)


def _names(rows: np.ndarray, strings: list[str]) -> np.ndarray:
    """What must match for two records to be the same op: the name, without a node name."""
    table = np.array([split_node(s)[0] for s in strings] + [""], dtype=object)
    ids = rows["name"].astype(np.int64)
    ids[(ids < 0) | (ids >= len(strings))] = len(strings)
    return table[ids]


def first_op_divergence(ops_a: np.ndarray, ops_b: np.ndarray, strings_a: list[str],
             strings_b: list[str], context: int = 3) -> OpDivergence | None:
    """Apply the injection rule to two aligned record streams (same window, same order)."""
    n = min(len(ops_a), len(ops_b))
    a, b = ops_a[:n], ops_b[:n]
    structure = (
        (a["step"] != b["step"]) | (a["kind"] != b["kind"])
        | (_names(a, strings_a) != _names(b, strings_b))
    )
    first_structure = int(np.argmax(structure)) if structure.any() else n
    compared = (a["flags"] & Flag.UNINIT_OUTPUT) == 0
    # An output of another size is a difference even in memory nobody reads yet (`empty`):
    # the size came from a Python value (a width a tuner drew), and a later op filling it
    # (`uniform_`) would otherwise "create" the difference from matching inputs.
    resized = a["numel"] != b["numel"]
    differs = ((a["out_fp"] != b["out_fp"]) & compared) | resized
    not_op = a["kind"] != Kind.OP
    inputs_match = (a["in_fp"] == b["in_fp"]) | not_op
    candidates = np.nonzero((differs & inputs_match)[:first_structure])[0]
    if len(candidates):
        i = int(candidates[0])
        entry = bool(not_op[i]) or int(a["scalar_fp"][i]) != int(b["scalar_fp"][i]) \
            or bool(resized[i])
        return OpDivergence(
            kind="entry" if entry else "op", position=i, row_a=a[i], row_b=b[i],
            reads_uninitialized=bool(int(a["taint_fp"][i]) != int(b["taint_fp"][i])),
            scalar_argument=not bool(not_op[i]) and entry,
            context=_context(a, b, differs, inputs_match, i, context),
        )
    if first_structure < n or len(ops_a) != len(ops_b):
        i = first_structure
        return OpDivergence(
            kind="structure", position=i,
            row_a=ops_a[i] if i < len(ops_a) else None,
            row_b=ops_b[i] if i < len(ops_b) else None,
            context=_context(a, b, differs, inputs_match, min(i, n - 1), context) if n else [],
        )
    anything = np.nonzero(differs)[0]
    if len(anything):  # every differing op also had differing inputs: origin not captured
        i = int(anything[0])
        return OpDivergence(kind="op", position=i, row_a=a[i], row_b=b[i], explained=False,
                            context=_context(a, b, differs, inputs_match, i, context))
    return None


def _context(a: np.ndarray, b: np.ndarray, differs: np.ndarray, inputs_match: np.ndarray,
             i: int, width: int) -> list[tuple[int, str]]:
    out = []
    for j in range(max(0, i - width), min(len(a), i + width + 1)):
        if not differs[j]:
            state = "same"
        elif inputs_match[j]:
            state = "differs (inputs same)"
        else:
            state = "differs (inputs differ)"
        out.append((j, state))
    return out


def mismatch_stats(x: np.ndarray, y: np.ndarray) -> dict[str, object]:
    """Element-wise comparison of one output from both runs (bitwise, NaN-aware)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return {"numel": int(x.size), "note": f"shapes/dtypes differ: {x.shape} {x.dtype} vs "
                f"{y.shape} {y.dtype}"}
    if x.size == 0:
        return {"mismatched_elements": 0, "numel": 0, "max_abs_diff": 0.0}
    xb = np.ascontiguousarray(x).view(np.uint8).reshape(x.size, -1)
    yb = np.ascontiguousarray(y).view(np.uint8).reshape(y.size, -1)
    mismatched = (xb != yb).any(axis=1)
    count = int(mismatched.sum())
    stats: dict[str, object] = {"mismatched_elements": count, "numel": int(x.size)}
    if count and (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        with np.errstate(all="ignore"):
            diff = np.abs(x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)
                          - y.astype(np.complex128 if np.iscomplexobj(y) else np.float64))
        flat = np.where(mismatched, diff.reshape(-1), -np.inf)
        flat = np.where(np.isnan(flat), np.inf, flat)  # NaN vs number counts as infinite
        where = int(np.argmax(flat))
        stats["max_abs_diff"] = float(np.abs(flat[where]))
        stats["max_abs_diff_at"] = [int(v) for v in np.unravel_index(where, x.shape)]
    elif count == 0:
        stats["max_abs_diff"] = 0.0
    return stats
