"""Re-runs aimed at one finding: narrowed down to its op, then measured.

A difference found in the step rows of a step without op-level recording is narrowed down
by re-running the pair with op-level recording of that step and the one before
(``narrow``); a finding whose outputs neither run kept is measured by two short runs that
save them (``measured``, the dump pass). The pipeline hands in how to run a pair
(``RunPair``: its schedule, fixes and output directory), so this module starts nothing
itself; ``job_narrow`` does the same for a torchrun job.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from nondet import compare
from nondet.analysis import capture_notes, finding_facts
from nondet.errors import ScriptFailed
from nondet.finding import entered_next_step, localize, measure_from_dumps, with_notes
from nondet.live import narrowing_window
from nondet.records import INIT_STEP
from nondet.report import Divergence
from nondet.runspec import Plan, RunResult
from nondet.schedule import Judge, never_stop
from nondet.store import Capture, open_capture


class RunPair(Protocol):
    """Two runs of the script with these plans, judged step by step (``pipeline``)."""

    def __call__(self, plans: tuple[Plan, Plan],
                 judge: Judge = never_stop) -> tuple[RunResult, RunResult]: ...


Stage = Callable[[str], None]  # tells the user what runs next (ProgressSink.stage)


def measured(run_pair: RunPair, stage: Stage, div: Divergence, op_capture: Capture,
             op_capture_b: Capture) -> tuple[Divergence, list[str]]:
    """The finding with the sizes of its difference: from the outputs the runs kept, else
    from two more runs (not for TensorFlow graph ops, which are hashed inside the graph and
    whose outputs are not saved)."""
    sized = measure_from_dumps(div, op_capture, op_capture_b)
    if sized is not None:
        return sized, []
    if finding_facts(div, op_capture)["framework"] == "tensorflow":
        return with_notes(div, "sizes are not measured for TensorFlow ops"), []
    return _measure(run_pair, stage, div, op_capture)


def narrow(run_pair: RunPair, stage: Stage, step: int, lockstep: bool, *,
           read_next: bool = False,
           ) -> tuple[tuple[Divergence, Capture, Capture] | None, list[str]]:
    """Re-run both with op-level recording for ``step`` and the one before: the finding with
    the captures it is in (None if the re-runs did not part there), and every capture written.
    With ``read_next`` (its end state differed in what no op of it changed: a thread drew
    from the generator after its last op) the step after is recorded too: it reads that.

    A timing-dependent cause may strike at another step in the re-runs. If they part
    elsewhere (or not at all by ``step``), the second attempt captures every op and runs
    until the runs first differ, wherever that is (and one step on, when only their RNG
    state differs there: ``UntilDifferent``).
    """
    # as nondet.live may have started them
    first_scope, first_window = narrowing_window(step, read_next)
    last = step + 1 if read_next else step
    attempts: list[tuple[str, list[int] | None, Any]] = [
        (first_scope, first_window, lambda k, _a, _b: k < last),
        ("every step until the runs differ", None, UntilDifferent()),
    ]
    written: list[str] = []
    for number, (scope, window, judge) in enumerate(attempts, start=1):
        again = " (second try)" if number == 2 else ""
        stage(f"narrowing down: op-level recording of {scope}, in two new runs{again}")
        # In lockstep the judge stops both runs (held, so they can be asked for the outputs
        # they kept); one after the other, the first attempt's runs stop themselves.
        stop_after = max(last, 0) if not lockstep and window is not None else None
        # labels name the files: the first try's captures are still open (run-a-ops.h5)
        suffix = "" if number == 1 else str(number)
        ra, rb = run_pair((Plan(f"a-ops{suffix}", window, stop_after=stop_after),
                           Plan(f"b-ops{suffix}", window, stop_after=stop_after)), judge)
        oa, ob = open_capture(ra.path), open_capture(rb.path)
        written += [str(oa.path), str(ob.path)]
        parted = compare.parted(oa.steps, ob.steps)
        steps = window if window is not None else oa.op_steps()
        if parted is None or not steps or parted.step < steps[0]:
            continue  # these runs did not part inside the window
        found = (localize(oa, ob, [s for s in steps if s <= parted.step])
                 or entered_next_step(oa, ob, parted.step, steps))
        if found is not None:
            # what the backends noted about recording ops (e.g. XLA functions recorded as a
            # whole) is said only by these runs: the first pair's captures lack it
            backend_notes = [n for n in capture_notes(oa, ob) if n not in found.notes]
            return (with_notes(found, f"the first difference was at step {step} in the first "
                               "two runs; op-level recording was re-run to find the op",
                               *backend_notes), oa, ob), written
    return None, written


def until_different(step: int, row_a: np.void | None, row_b: np.void | None) -> bool:
    """A judge: run on while both runs' rows match (stop at the first that differs)."""
    if row_a is None or row_b is None:
        return False
    differing = compare.rows_differ(row_a, row_b)
    # data that reached no training state (a clock reading handed to torch) is no parting
    return not differing or compare.data_only(row_a, row_b, differing)


def until_training_differs(step: int, row_a: np.void | None, row_b: np.void | None) -> bool:
    """A judge: run on while both runs' training state matches (past RNG state that
    differs: ``compare.parted_in_training`` then decides whether it reached training)."""
    if row_a is None or row_b is None:
        return False
    return not compare.training_differs(row_a, row_b)


class UntilDifferent:
    """A judge for runs that record every op: run on while both runs' rows match, and one
    step past the first step whose rows differ only in state no verdict follows (the RNG's,
    drawn by a thread after the step's last op): the step after reads it
    (``finding.entered_next_step``)."""

    def __init__(self) -> None:
        self._state_only_at: int | None = None

    def __call__(self, step: int, row_a: np.void | None, row_b: np.void | None) -> bool:
        if until_different(step, row_a, row_b):
            return True
        if row_a is None or row_b is None or compare.training_differs(row_a, row_b):
            return False
        if self._state_only_at is None:
            self._state_only_at = step
        return step == self._state_only_at


def _measure(run_pair: RunPair, stage: Stage, div: Divergence,
             capture: Capture) -> tuple[Divergence, list[str]]:
    """The dump pass: save the finding's outputs in two more runs and compare them."""
    op_steps = op_steps_of(capture)
    step = INIT_STEP if div.step is None else div.step
    stage(f"measuring the difference: two short runs up to op #{div.op_index}")
    plans = (Plan("a-dump", op_steps, stop_after=max(step, 0), dump=(step, div.op_index or 0)),
             Plan("b-dump", op_steps, stop_after=max(step, 0), dump=(step, div.op_index or 0)))
    try:
        ra, rb = run_pair(plans)
    except ScriptFailed as exc:
        return with_notes(div, f"could not measure the difference: {exc}"), []
    da, db = open_capture(ra.path), open_capture(rb.path)
    written = [str(da.path), str(db.path)]
    sized = measure_from_dumps(div, da, db)
    if sized is None:
        return with_notes(div, "the measuring runs did not reach the op again; sizes not "
                          "measured"), written
    if sized.mismatched_elements == 0:
        return with_notes(sized, "in the measuring runs this op happened to give identical "
                          "outputs; the difference is intermittent"), written
    return sized, written


def op_steps_of(capture: Capture) -> list[int] | None:
    """The steps a capture recorded op by op (None: every step)."""
    value = capture.attrs.get("op_steps", "all")
    if value == "all":
        return None
    return list(json.loads(value)) if isinstance(value, str) else list(value)
