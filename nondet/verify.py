"""Verification: re-run the pair with a suggested fix applied from outside, and see whether
the runs now repeat.

For each suggestion in rank order, each intervention its recipe lists
(``nondet.interventions``) is applied to two new runs, which record what the first two
recorded (so step times compare like with like) and stop as soon as their step rows
part, or after the last step the first two runs compared (or, with ``run_on``, where the
search for another source would stop its runs with every fix: the pair that verifies a
fix then also answers whether the runs now repeat, one pair of runs fewer for a job with
one source). The first intervention under
which both runs repeat bitwise over those steps verifies its suggestion; verification
stops there and that suggestion ranks first. A fix that makes the script fail did not
help (its error line is kept), and the next is tried; one the child could not apply
(``interventions.NOT_APPLIED`` in its log) is neither verified nor refuted. Suggestions
with no intervention are a code change only the user can make (``verified`` stays None).
At most ``MAX_TRIES`` pairs are run per finding.

Given the finding's step, a fix also counts as verified when the runs with it repeat
through that step and part only later: it removed this source, and what parts them then
is another one (``Suggestion.parts_again``; ``nondet.sources`` localizes it from the
verifying pair's captures, ``Suggestion.verified_captures``). Likewise when they part at
the finding's step itself but its first differing op is now another, later one (both
pairs record that step's ops): two sources in one step, an unseeded shuffle and a racing
``index_put_``, where the first fix alone was reported as "did not help" and the second
source never examined.

The cost is the median step time of the fixed pair against the first pair's, from the
step rows' wall clock (steps without op records, so the op window does not count),
else wall time per step.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from nondet import compare, interventions
from nondet.channel import COMPLETE
from nondet.errors import ScriptFailed
from nondet.recipe import Suggestion
from nondet.runspec import Plan, RunResult
from nondet.store import Capture, open_capture

#: Runs a pair with the given interventions applied, judged by the given function.
RunPair = Callable[[tuple[Plan, Plan], tuple[str, ...]], tuple[RunResult, RunResult]]


#: Interventions tried at most per finding: each costs a pair of runs.
MAX_TRIES = 4


@dataclass
class Outcome:
    """What one intervention did to the pair."""

    repeated: bool
    steps: int  # steps both runs had and compared
    step_time: float | None  # seconds per step (median), None if not measurable
    error: str = ""  # the script failed with the intervention: its error line
    captures: tuple[str, ...] = ()
    not_applied: str = ""  # the child could not apply it: its line (see apply_requested)
    parted_at: int | None = None  # the step the runs with it parted, if they did
    moved_to: str = ""  # they parted at the finding's step, first at this later op
    unstable: str = ""  # held in the first pair, not in a later one (--verify-pairs)
    confirmed: int = 0  # pairs it held in, when re-checked
    ran_on: bool = False  # it repeated as far as the runs with every fix would go



#: Why a suggestion without an intervention was not tried, by the kind of its fix (an
#: environment variable was called "a code change").
_NOT_APPLIED = {
    "code": "a code change: cannot be applied from outside",
    "env": "an environment setting nondet has no switch for: set it and run nondet again",
    "advice": "advice, not a change nondet can make: not tried",
}

def verify(suggestions: Sequence[Suggestion], first: tuple[Capture, Capture],
           run_pair: RunPair, stage: Callable[[str], None],
           op_steps: list[int] | None = None, finding_step: int | None = None,
           pairs: int = 1, upto: int | None = None, run_on: bool = False,
           run_on_stop: int | None = None) -> tuple[list[Suggestion], list[str]]:
    """The suggestions with ``verified``, steps and cost filled in (the verified one first),
    and the captures the verification runs wrote. With ``pairs`` > 1 a fix is verified only
    if it holds in that many pairs (``--verify-pairs``: a race may miss one pair by chance).
    ``upto``: the last step the runs with a fix go to, when the first pair went further
    than a verification needs (a torchrun job runs to its end: ``nondet.job_fixes``).

    ``run_on``: each fix's first pair does not stop after the steps it needs but runs on
    to ``run_on_stop`` (None: the script's end), still ending a few steps after its runs
    part. Where the fix holds, that pair is also the one ``nondet.sources`` would run next
    to see whether the runs now repeat with it (``Suggestion.ran_on``), a pair of runs
    saved; where it does not, it stops as soon as the runs part, as before."""
    a, b = first
    last = _last_common_step(a.steps, b.steps)
    if last is None or compare.parted(a.steps, b.steps) is None:
        return list(suggestions), []  # nothing to show repeating: no step rows parted
    if upto is not None:
        last = min(last, upto)
    base_time = step_time(a.steps, b.steps)
    original = None if finding_step is None else first_op(a, b, finding_step)
    tried: dict[str, Outcome] = {}
    written: list[str] = []
    winner: Suggestion | None = None
    for suggestion in suggestions:
        ids = suggestion.recipe.apply
        if not ids:
            suggestion.verify_note = _NOT_APPLIED.get(suggestion.fix_kind, _NOT_APPLIED["code"])
            continue
        if winner is not None:
            continue  # not tried: an earlier fix was verified
        notes = []
        for fix_id in ids:
            outcome = tried.get(fix_id)
            if outcome is None and len(tried) >= MAX_TRIES:
                notes.append(f"{interventions.describe([fix_id])}: not tried (at most "
                             f"{MAX_TRIES} fixes are tried)")
                continue
            if outcome is None:
                stage(f"verifying a fix: both runs again with {interventions.describe([fix_id])}")
                number = len(tried) + 1
                runs_on = run_on and finding_step is not None  # parts_again needs the step
                outcome = _try(fix_id, str(number), last, op_steps, run_pair,
                               (finding_step, original), runs_on,
                               None if run_on_stop is None else max(last, run_on_stop))
                written += outcome.captures
                for k in range(2, pairs + 1):
                    if not _holds(outcome, finding_step):
                        break
                    stage(f"re-checking the fix: pair {k} of {pairs}")
                    again = _try(fix_id, f"{number}-{k}", last, op_steps, run_pair,
                                 (finding_step, original))
                    written += again.captures
                    if not _holds(again, finding_step):
                        outcome = replace(again, unstable=f"held in {k - 1} of {k} pairs")
                if pairs > 1 and _holds(outcome, finding_step):
                    outcome.confirmed = pairs
                tried[fix_id] = outcome
            suggestion.verified_steps = outcome.steps
            removed = not outcome.repeated and _holds(outcome, finding_step)
            if outcome.repeated or removed:
                repeat = (f"the runs repeat over {outcome.steps} steps" if outcome.repeated
                          else f"the first difference of step {_name(finding_step)} moves "
                               f"to a later op, {outcome.moved_to} (another source)"
                          if outcome.moved_to
                          else f"the runs repeat past step {_name(finding_step)} and part "
                               f"again at step {outcome.parted_at} (another source)")
                if outcome.confirmed:
                    repeat += f", in each of {outcome.confirmed} pairs"
                suggestion.verified, suggestion.verify_note = True, (
                    f"verified with {interventions.describe([fix_id])}: {repeat}"
                    + (f" ({'; '.join(notes)})" if notes else ""))
                if removed:
                    suggestion.parts_again = outcome.parted_at
                suggestion.verified_captures = outcome.captures
                suggestion.ran_on = outcome.ran_on
                suggestion.cost_ratio = ratio(outcome.step_time, base_time)
                suggestion.verified_with = fix_id
                winner = suggestion
                break
            notes.append(f"{interventions.describe([fix_id])}: " + _failure(outcome))
        if winner is not suggestion:
            # did not help only if some intervention actually ran and the runs still parted
            helped_not = any(not tried[i].not_applied for i in ids if i in tried)
            suggestion.verified = False if helped_not else None
            suggestion.verify_note = "; ".join(notes)
    ordered = list(suggestions)
    if winner is not None:
        ordered.remove(winner)
        ordered.insert(0, winner)
    return ordered, written


def _holds(outcome: Outcome, finding_step: int | None) -> bool:
    """The runs repeated with the fix, or repeated past the finding's step (another source
    parts them later)."""
    if outcome.unstable or outcome.not_applied:
        return False
    return outcome.repeated or bool(outcome.moved_to) or (
        finding_step is not None and outcome.parted_at is not None
        and outcome.parted_at > finding_step)


#: Where a step's first difference is: (record position, op name, source line, and how many
#: records of that name and line came before it in the step).
OpPlace = tuple[int, str, str, int]


def first_op(a: Capture, b: Capture, step: int) -> OpPlace | None:
    """The record that first parts ``a`` and ``b`` at ``step`` by the injection rule,
    or None when either recorded no ops there or the records do not line up."""
    ops_a, ops_b = a.ops(step), b.ops(step)
    if not len(ops_a) or not len(ops_b):
        return None
    found = compare.first_op_divergence(ops_a, ops_b, a.strings, b.strings)
    if found is None or found.kind == "structure" or found.row_a is None:
        return None
    places = _places(a, ops_a[:found.position + 1])
    return found.position, *places[-1]


def _places(c: Capture, ops: np.ndarray) -> list[tuple[str, str, int]]:
    """Each record's (name, source, occurrence of that name and source so far)."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for row in ops:
        key = (c.string(int(row["name"])), c.string(int(row["source"])))
        out.append((*key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return out


def _moved(ca: Capture, cb: Capture, step: int, original: OpPlace) -> str:
    """With a fix the pair still parts at ``step``: the op it now parts at, when the op that
    parted the first pair now repeats and the first difference comes after it ("" else).
    Where the original op cannot be found repeating (a race that parts the step at another
    record each time: a DataLoader's batches in completion order), nothing moved."""
    now = first_op(ca, cb, step)
    if now is None or now[0] <= original[0] or now[1:3] == original[1:3]:
        return ""
    ops_a, ops_b = ca.ops(step), cb.ops(step)
    places_a = _places(ca, ops_a)
    if original[1:] not in places_a:
        return ""
    at = places_a.index(original[1:])
    if at >= len(ops_b) or int(ops_a[at]["out_fp"]) != int(ops_b[at]["out_fp"]):
        return ""
    name, source = now[1], now[2]
    return f"{name} at {source}" if source else name


def _failure(outcome: Outcome) -> str:
    if outcome.unstable:
        return f"did not hold in every pair ({outcome.unstable})"
    if outcome.not_applied:
        return f"could not be applied from outside ({outcome.not_applied})"
    if outcome.error:
        return f"the script failed with it ({outcome.error})"
    return "did not help (the runs still part)"


def _try(fix_id: str, number: str, last: int, op_steps: list[int] | None,
         run_pair: RunPair, finding: tuple[int | None, OpPlace | None] = (None, None),
         runs_on: bool = False, on_to: int | None = None) -> Outcome:
    """One pair with the intervention. ``finding``: the finding's step and the op that
    first parted the first pair there, to tell a difference that moved to a later op.
    ``runs_on``: the pair goes past ``last``, on to step ``on_to`` (None: the script's
    end), unless its runs part."""
    stop_after = on_to if runs_on else last
    plans = (Plan(f"a-fix{number}", op_steps, stop_after=stop_after),
             Plan(f"b-fix{number}", op_steps, stop_after=stop_after))
    try:
        ra, rb = run_pair(plans, (fix_id,))
    except ScriptFailed as exc:
        return Outcome(False, 0, None, error=str(exc).split("; its output is in")[0])
    ca, cb = open_capture(ra.path), open_capture(rb.path)
    captures = (str(ca.path), str(cb.path))
    parted = compare.parted_in_training(ca.steps, cb.steps, last=last)
    common = _last_common_step(ca.steps, cb.steps)
    # Repeating means: every step up to the last one the first pair compared, bitwise.
    repeated = parted is None and common is not None and common >= last
    steps = len({s for s in ca.steps["step"].tolist() if s >= 0}
                & set(cb.steps["step"].tolist()))  # training steps: init is not one
    not_applied = _not_applied(ra, fix_id) or _not_applied(rb, fix_id)
    moved = ""
    if parted is not None:  # steps repeated: those before the one they parted at
        steps = len({s for s in ca.steps["step"].tolist() if 0 <= s < parted.step})
        step, original = finding
        if parted.step == step and original is not None and not not_applied:
            moved = _moved(ca, cb, step, original)
    # A pair that parted at the finding's step ran no step that repeated, only op-captured
    # ones: its step time says nothing of what the fix costs. Like with like: the steps the
    # first pair ran (a pair that ran on has later ones, which cost less than the first).
    cost = None if moved else step_time(ca.steps[ca.steps["step"] <= last],
                                        cb.steps[cb.steps["step"] <= last])
    # It ran as far as a pair run on with the fix would: the script's end, or the step asked
    ran_on = runs_on and parted is None and not not_applied and common is not None and (
        ra.status == rb.status == COMPLETE if on_to is None else common >= on_to)
    return Outcome(repeated and not not_applied, steps, cost,
                   captures=captures, not_applied=not_applied,
                   parted_at=None if parted is None else parted.step, moved_to=moved,
                   ran_on=ran_on)


def _name(step: int | None) -> str:
    return "init" if step is None or step < 0 else str(step)


def _not_applied(result: RunResult, fix_id: str) -> str:
    """The line the child wrote when it could not apply ``fix_id`` (or "")."""
    mark = f"{interventions.NOT_APPLIED} {fix_id}:"
    try:
        with open(result.log_path, encoding="utf-8", errors="replace") as log:
            for line in log:
                if line.startswith(mark):
                    return line[len(mark):].strip()
    except OSError:
        return ""
    return ""


def _last_common_step(steps_a: np.ndarray, steps_b: np.ndarray) -> int | None:
    common = set(steps_a["step"].tolist()) & set(steps_b["step"].tolist())
    return max(common) if common else None


def step_time(*runs: np.ndarray) -> float | None:
    """Seconds per training step: the shortest over the runs' step rows without op
    records (a step is only ever slowed by what else runs, never sped up: the first pair's
    growth steps share the machine with the narrowing runs starting up beside them, which
    the median of a few steps kept); else the wall time of the last step over the number of
    steps. A fix may still cost under 1x: deterministic ``index_put`` on this CPU is faster
    than the parallel atomic adds it replaces (44-62 ms against 71-74 ms a step)."""
    deltas: list[float] = []
    fallback: list[float] = []
    for rows in runs:
        rows = np.sort(rows[rows["step"] >= 0], order="step")
        if not len(rows):
            continue
        fallback.append(float(rows["wall"][-1]) / len(rows))
        for prev, row in itertools.pairwise(rows):
            if int(row["n_records"]) == 0 and int(row["step"]) == int(prev["step"]) + 1:
                deltas.append(float(row["wall"] - prev["wall"]))
    if len(deltas) >= 2:
        return min(deltas)
    return statistics.median(fallback) if fallback else None


def ratio(with_fix: float | None, without: float | None) -> float | None:
    if not with_fix or not without:
        return None
    return round(with_fix / without, 2)
