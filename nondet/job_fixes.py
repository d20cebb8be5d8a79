"""Fixes verified for a torchrun job's finding, and every further source, as for one
process: ``verify.verify`` and ``sources.every_source`` reused through ``JobSteps``.

Each candidate fix is applied to every rank of two new jobs (the interventions travel in
the environment torchrun passes on to its workers: ``interventions.environment``). The
jobs stop at the same step boundary on every rank (``Plan.stop_after``), ``GROWTH_STEPS``
after the finding's step, as the first pair of a single process does: a job cannot be
stopped early when its runs part (its ranks would block in a collective).

``verify.py`` compares two runs; a job has N. ``JobSteps`` hands it one rank's pair: the
rank whose step rows part first (or, if none part, the one that ran fewest steps), so
"the runs repeat" means that every rank repeated, and "parted at step S" is the earliest
step any rank parted at. ``explain`` then compares every rank of the jobs that pair came
from (``job_narrow.explain``: narrowed down as the first finding was).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nondet import compare, job_narrow, narrow, sources, verify
from nondet.analysis import GROWTH_STEPS
from nondet.distributed import STALL_AFTER, JobResult
from nondet.jobrun import run_checked
from nondet.jobs import Options, first_plan, rank_results
from nondet.recipe import Suggestion
from nondet.records import INIT_STEP
from nondet.report import CombinedFix, Divergence, Source
from nondet.runspec import Plan, RunResult, Target
from nondet.store import Capture, open_capture


class JobSteps:
    """The pipeline's steps (``sources.Steps``) for a torchrun job: jobs with fixes applied
    and their captures in the given folder."""

    def __init__(self, target: Target, options: Options, stage: Callable[[str], None],
                 stall_after: float = STALL_AFTER) -> None:
        self.target, self.options, self.stage = target, options, stage
        self.stall_after = stall_after
        self._jobs: dict[str, tuple[JobResult, JobResult]] = {}  # by run a's rank capture
        self.written: list[str] = []  # every rank's capture of every job run here

    def run_pair(self, plans: tuple[Plan, Plan], apply: tuple[str, ...],
                 folder: Path) -> tuple[RunResult, RunResult]:
        """Two jobs, one after the other, reduced to the rank pair verify.py compares."""
        ja, jb = (run_checked(self.target, plan, self.options.seed, folder, apply,
                              self.options.echo, self.stall_after) for plan in plans)
        self.written += [str(r.path) for job in (ja, jb) for r in job.ranks]
        return self.representative(ja, jb)

    def representative(self, ja: JobResult, jb: JobResult) -> tuple[RunResult, RunResult]:
        """The rank whose step rows part first, else the one with the fewest common steps
        (module docstring); its jobs are kept for ``explain``."""
        pairs = rank_results(ja, jb)

        def key(rank: int) -> tuple[int, int, int]:
            a, b = (open_capture(r.path).steps for r in pairs[rank])
            parted = compare.parted(a, b)
            common = set(a["step"].tolist()) & set(b["step"].tolist())
            return (parted.step if parted is not None else 1 << 30,
                    max(common, default=INIT_STEP - 1), rank)

        chosen = pairs[min(pairs, key=key)]
        self._jobs[str(chosen[0].path)] = (ja, jb)
        return chosen

    def run_on(self, apply: tuple[str, ...], folder: Path,
               stop_after: int | None) -> tuple[Path, Path]:
        op_steps, last = first_plan(self.options)
        stop = stop_after if stop_after is not None else last
        ra, rb = self.run_pair((Plan("a-all", op_steps, stop_after=stop),
                                Plan("b-all", op_steps, stop_after=stop)), apply, folder)
        return ra.path, rb.path

    def explain(self, apply: tuple[str, ...], folder: Path, a: Capture, b: Capture,
                ) -> tuple[Divergence | None, list[Suggestion], list[str]]:
        """Every rank of the jobs ``a`` came from compared, narrowed down if need be."""
        found, suggestions, written = job_narrow.explain(
            self.target, self.options, self.stage, self._jobs[str(a.path)], folder, apply,
            self.stall_after)
        self.written += written
        return found.first_divergence, suggestions, []

    def verify(self, apply: tuple[str, ...], folder: Path, suggestions: list[Suggestion],
               pair: tuple[Capture, Capture], finding_step: int,
               ) -> tuple[list[Suggestion], list[str]]:
        def run_fixed(plans: tuple[Plan, Plan], ids: tuple[str, ...],
                      ) -> tuple[RunResult, RunResult]:
            return self.run_pair(plans, apply + ids, folder)

        return verify.verify(suggestions, pair, run_fixed, self.stage,
                             narrow.op_steps_of(pair[0]), finding_step,
                             self.options.budget.pairs,
                             upto=max(finding_step, 0) + GROWTH_STEPS)


def verify_finding(target: Target, options: Options, stage: Callable[[str], None],
                   first: tuple[JobResult, JobResult], div: Divergence,
                   suggestions: list[Suggestion], stall_after: float = STALL_AFTER,
                   ) -> tuple[list[Suggestion], list[Source], CombinedFix | None, list[str]]:
    """The suggestions verified (the verified one first), every source, the combined fix
    and the captures written, for the finding ``div`` of the jobs ``first``."""
    steps = JobSteps(target, options, stage, stall_after)
    ra, rb = steps.representative(*first)
    pair = (open_capture(ra.path), open_capture(rb.path))
    step = INIT_STEP if div.step is None else div.step
    suggestions, _ = steps.verify((), options.out_dir, suggestions, pair, step)
    whole = all(r.status == "complete" for job in first for r in job.ranks)
    every, combined, _ = sources.every_source(
        Source(div, suggestions), pair, steps, options.out_dir, options.budget, stage,
        whole_script=whole)
    return suggestions, every, combined, steps.written
