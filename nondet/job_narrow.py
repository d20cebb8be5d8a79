"""A job's finding, narrowed down to its op as for one process (``narrow.narrow``).

The first jobs record ops at init and step 0 only (unless ``--ops all``). When they part
at a later step, only the step is known; then two more jobs (``run-a-ops/``,
``run-b-ops/``) record that step and the one before op by op (and init: see
``explain``), stop on every rank at that step's boundary, and are compared rank by rank
(``jobs.compare_jobs``): the op found there is the finding, with a note saying so. One
attempt: if the re-run jobs do not part inside that window (a rare race), the step-level
finding stays, with a note to use ``--ops all``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from nondet.analysis import Comparison, with_suggestions
from nondet.distributed import STALL_AFTER, JobResult
from nondet.finding import with_notes
from nondet.jobrun import run_checked
from nondet.jobs import Options, compare_jobs, first_plan, rank_path
from nondet.recipe import Suggestion
from nondet.records import INIT_STEP
from nondet.report import Divergence
from nondet.runspec import Plan, Target
from nondet.store import open_capture


def explain(target: Target, options: Options, stage: Callable[[str], None],
            jobs: tuple[JobResult, JobResult], folder: Path, apply: tuple[str, ...],
            stall_after: float = STALL_AFTER,
            ) -> tuple[Comparison, list[Suggestion], list[str]]:
    """The comparison of two jobs with its finding narrowed down when it needs it, the
    recipes for it, and the captures the extra jobs wrote."""
    found, rank = compare_jobs(*jobs)
    div = found.first_divergence
    if div is None:
        return found, [], []
    base, written = jobs[0], []
    if needs_narrowing(div, first_plan(options)[0]):
        assert div.step is not None
        step = div.step
        stage(f"narrowing down: op-level recording of steps {step - 1} and {step}, "
              "in two new jobs")
        # init too: memory a job allocates there and writes later (DDP's gradient buckets)
        # is known to be uninitialized only if its allocation was recorded
        window = sorted({INIT_STEP, step - 1, step})
        plans = [Plan(f"{x}-ops", window, stop_after=step) for x in ("a", "b")]
        ja, jb = (run_checked(target, plan, options.seed, folder, apply, options.echo,
                              stall_after) for plan in plans)
        written = [str(r.path) for job in (ja, jb) for r in job.ranks]
        again, again_rank = compare_jobs(ja, jb)
        narrowed = again.first_divergence
        if narrowed is not None and narrowed.localized and not needs_narrowing(
                narrowed, window):
            div = with_notes(narrowed, f"the first difference was at step {step} in the "
                             "first two jobs; op-level recording was re-run to find the op")
            base, rank = ja, again_rank
        else:
            div = with_notes(div, f"the difference at step {step} did not recur in the "
                             "op-level re-runs: it is rare or timing-dependent; try `nondet "
                             "run --ops all` to capture every op in the first two jobs")
        found = replace(found, first_divergence=div)
    found, suggestions = with_suggestions(found, open_capture(rank_path(base, rank)))
    return found, suggestions, written


def needs_narrowing(div: Divergence, op_steps: list[int] | None) -> bool:
    """Is only the step of this finding known, at a step the op window did not cover (or
    is it data named from the step rows without the line it entered at)?"""
    if div.step is None or div.step < 1 or op_steps is None or div.step in op_steps:
        return False
    if div.kind == "structure":
        return False  # different ops ran: the op records already say where
    unplaced_entry = div.kind == "entry" and div.op_index is None and not div.source
    return not div.localized or unplaced_entry
