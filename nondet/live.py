"""The first pair's live judge, and the narrowing runs it starts early.

A first pair that parts at a step it did not record op by op (TensorFlow declines step 0 of
its op window: docs/architecture.md, "The first pair") is followed by a narrowing pair
(``narrow.narrow``), whose start-up (interpreter, framework import, the script's own
set-up up to its first step) costs seconds. In lockstep those two runs are started as soon
as the first pair parts (``Early.anticipate``): they run to their init row and wait there
for their turn, while the first pair runs its growth steps and stops, so their start-up
overlaps it. The schedule gets them when the narrowing asks for exactly their plan
(``Early.take``); any not taken are stopped and their files removed (``Early.discard``).
A wrong guess costs CPU time, never a result: a run is only ever used for the plan it was
started with.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np

from nondet import compare
from nondet.analysis import GROWTH_STEPS
from nondet.finding import first_differing_entry, placed_entry
from nondet.launch import CapturedRun
from nondet.records import INIT_STEP
from nondet.runspec import Plan
from nondet.schedule import KEEP_BYTES
from nondet.stream import RunStream

#: How long a discarded early run may take to stop at its turn before it is ended by signal.
STOP_GRACE = 30.0


class ProgressSink(Protocol):
    def stage(self, text: str) -> None: ...
    def status(self, text: str) -> None: ...


def step_name(step: int) -> str:
    return "init" if step == INIT_STEP else str(step)


def narrowing_window(step: int, read_next: bool = False) -> tuple[str, list[int]]:
    """(description, op steps) of the first narrowing attempt for a difference at ``step``:
    that step and the one before; with ``read_next`` (only state outside training differs
    there, a generator a thread drew from after the step's last op) the step after too,
    which reads it."""
    scope, window = (f"steps {step_name(step - 1)} and {step}", [step - 1, step]) \
        if step > INIT_STEP else ("the init step", [step])
    if read_next:
        return f"{scope} and the step after", [*window, step + 1]
    return scope, window


class LiveCompare:
    """Judges each step as soon as both runs have it: after the first difference in the
    training state the runs go on for GROWTH_STEPS more steps (to show the difference
    growing), then stop. A difference only in state the verdict does not follow (RNG state,
    probes) stops nothing: a Keras random layer in a tf.data map advances its seed as far
    as prefetching ran ahead, and stopping there gave a "deterministic" verdict on the first
    few steps of a long job. ``on_difference(step, row_a, row_b)`` is told of the first
    difference of any kind (once), when the training state first differs."""

    def __init__(self, progress: ProgressSink,
                 on_difference: Callable[[int, np.void, np.void], None] | None = None,
                 ) -> None:
        self.first_difference: int | None = None
        self.training_difference: int | None = None
        self.progress = progress
        self.on_difference = on_difference
        self._first: tuple[int, np.void, np.void] | None = None  # step and rows

    def judge(self, step: int, row_a: np.void | None, row_b: np.void | None) -> bool:
        """True to keep both runs going."""
        if row_a is None or row_b is None:
            return False  # one run ended: nothing more to compare with
        differing = compare.rows_differ(row_a, row_b) if self._first is None else ()
        if differing and not compare.data_only(row_a, row_b, differing):
            # (data that reached nothing that trains, a clock reading handed to torch, is
            # passed over as compare.first_step_divergence does)
            self._first = (step, row_a, row_b)
            self.first_difference = step
        if self.training_difference is None and self._first is not None \
                and compare.training_differs(row_a, row_b):
            self.training_difference = step
            first, first_a, first_b = self._first
            self.progress.stage(f"the runs differ at step {step_name(first)}; going on "
                                f"{GROWTH_STEPS} steps to see the difference grow")
            if self.on_difference is not None:
                self.on_difference(first, first_a, first_b)
        if step >= 0:
            self.progress.status(f"step {step}: both runs done")
        return self.training_difference is None or step < self.training_difference + GROWTH_STEPS


class Early:
    """Narrowing runs started while the first pair still runs (module docstring).

    ``make_run`` makes a run of the invocation (the pipeline's factory, before any early run
    is consulted). Thread-safe: ``anticipate`` runs on a pump thread of the first pair.
    """

    def __init__(self, make_run: Callable[[Plan], CapturedRun]) -> None:
        self.make_run = make_run
        self._runs: dict[str, CapturedRun] = {}
        self._first: dict[str, RunStream] = {}  # the first pair's runs, by label
        self._lock = threading.Lock()
        self._closed = False

    def watch(self, label: str, run: RunStream) -> None:
        """A run of the first pair (``label`` "a" or "b"): its data rows tell ``anticipate``
        whether the step rows already name the finding."""
        self._first[label] = run

    def anticipate(self, step: int, row_a: np.void, row_b: np.void) -> None:
        """The first pair parts at ``step``: if neither run recorded that step op by op (its
        rows count no op records) and the step rows do not name the data that entered at
        its line, start the narrowing pair's runs now."""
        if int(row_a["n_records"]) and int(row_b["n_records"]):
            return  # the first pair has the step's op records: nothing to re-run
        if self._named_by_rows(step, row_a, row_b):
            return  # the data entry is the finding: nothing to re-run (pipeline._explain)
        _, window = narrowing_window(
            step, read_next=compare.state_only(compare.rows_differ(row_a, row_b)))
        with self._lock:
            if self._closed or self._runs:
                return
            for label in ("a-ops", "b-ops"):
                # exactly what narrow.narrow's lockstep pair asks for (schedule.Lockstep)
                plan = Plan(label, window, lockstep=True, keep_bytes=KEEP_BYTES)
                run = self.make_run(plan)
                try:
                    run.start()
                except Exception:
                    return  # not started: the narrowing starts its own, as without this
                self._runs[label] = run

    def _named_by_rows(self, step: int, row_a: np.void, row_b: np.void) -> bool:
        """The first differing field of the step is its data, and its first differing
        entry is named with its line (``finding._data_entry_divergence`` names it so)."""
        fields = compare.rows_differ(row_a, row_b)
        a, b = self._first.get("a"), self._first.get("b")
        if not fields or fields[0] != "data_fp" or a is None or b is None:
            return False
        entries = []
        for run in (a, b):
            strings = list(run.strings)
            entries.append([(strings[name] if 0 <= name < len(strings) else "", fp)
                            for name, fp in run.data_rows.get(step, [])])
        first = first_differing_entry(entries[0], entries[1])
        if first is None:
            return False
        label = entries[0][first][0]
        return label == entries[1][first][0] and placed_entry(label)

    def take(self, plan: Plan) -> CapturedRun | None:
        """The early run started with exactly ``plan``, once. A run of the same label with
        another plan is discarded first (it would write the same files)."""
        with self._lock:
            run = self._runs.pop(plan.label, None)
        if run is None:
            return None
        if run.plan == plan:
            return run  # already started: the schedule's start() does nothing more
        _stop(run)
        return None

    def discard(self) -> None:
        """Stop every early run not taken, and remove its capture and log (nondet's own
        files in this invocation's directory: a run that never ran a step has no result)."""
        with self._lock:
            self._closed = True
            runs, self._runs = list(self._runs.values()), {}
        for run in runs:
            _stop(run)


def _stop(run: CapturedRun) -> None:
    run.request_stop()  # it waits for its turn after init: STOP ends it there
    try:
        run.wait(timeout=STOP_GRACE)
    except TimeoutError:
        run.interrupt(forward=True)
    for path in (run.path, run.log_path):
        with contextlib.suppress(OSError):
            path.unlink()

