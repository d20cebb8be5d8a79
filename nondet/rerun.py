"""The pipeline's own steps (run, narrow and explain, verify) with fixes applied and captures
written in a folder of their own: what ``nondet.sources`` needs to find the next source the
way the first was found. Kept apart so that pipeline.py stays orchestration only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from nondet import narrow, pipeline, verify
from nondet.live import LiveCompare
from nondet.recipe import Suggestion
from nondet.report import Divergence
from nondet.runspec import Plan, RunResult, Target
from nondet.store import Capture


class PipelineSteps:
    """The pipeline's own steps, with fixes applied, for ``sources.every_source``."""

    def __init__(self, target: Target, options: pipeline.Options,
                 progress: pipeline.ProgressSink) -> None:
        self.target, self.options, self.progress = target, options, progress

    def _with(self, apply: tuple[str, ...], folder: Path) -> pipeline.Options:
        return replace(self.options, apply=apply, out_dir=folder)

    def run_on(self, apply: tuple[str, ...], folder: Path,
               stop_after: int | None) -> tuple[Path, Path]:
        op_steps, last = pipeline._first_plan(self.options)
        stop = stop_after if stop_after is not None else last
        ra, rb = pipeline._run_pair(self.target, (Plan("a-all", op_steps, stop_after=stop),
                                         Plan("b-all", op_steps, stop_after=stop)),
                           self._with(apply, folder), self.progress,
                           judge=LiveCompare(self.progress).judge)
        return ra.path, rb.path

    def explain(self, apply: tuple[str, ...], folder: Path, a: Capture, b: Capture,
                ) -> tuple[Divergence | None, list[Suggestion], list[str]]:
        found, suggestions, written = pipeline._explain(self.target, self._with(apply, folder),
                                               self.progress, a, b)
        return found.first_divergence, suggestions, written

    def verify(self, apply: tuple[str, ...], folder: Path, suggestions: list[Suggestion],
               pair: tuple[Capture, Capture], finding_step: int,
               ) -> tuple[list[Suggestion], list[str]]:
        def run_fixed(plans: tuple[Plan, Plan], ids: tuple[str, ...],
                      ) -> tuple[RunResult, RunResult]:
            return pipeline._run_pair(self.target, plans, self._with(apply + ids, folder),
                             self.progress, judge=narrow.until_training_differs)

        # the verifying pair runs on as far as run_on would (sources.every_source)
        steps = self.options.budget.steps
        return verify.verify(suggestions, pair, run_fixed, self.progress.stage,
                             narrow.op_steps_of(pair[0]), finding_step,
                             self.options.budget.pairs, run_on=True,
                             run_on_stop=(steps - 1 if steps is not None
                                          else pipeline._first_plan(self.options)[1]))
