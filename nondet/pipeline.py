"""From a script to a report: launch, record, compare, localize, explain.

1. Run A and B with step-level recording (op-level for init and step 0, where most
   divergences start), taking turns step by step (``schedule.Lockstep``; one after the other
   on GPU machines), comparing each step as soon as both have it, and stopping both a few
   steps after the first difference.
2. If that step had no op-level recording (or only its step rows name the data that
   differs, without a line), re-run both recording the ops of it and the step before
   (``nondet.narrow``; in lockstep these runs start as soon as the first pair parts:
   ``nondet.live``).
3. Apply the injection rule to the op records; then re-run both once more up to the
   finding and save its outputs, to count how many elements differ and by how much
   (``narrow.measured``).
4. Look the finding up in the recipe table; with ``Options.verify``, re-run the pair with
   each suggested fix applied from outside until one makes the runs repeat (``verify``),
   then run on with it applied to find every further source (``sources``).
5. Build the report once from these parts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from nondet import (
    baseline,
    compare,
    environment,
    interventions,
    jobs,
    narrow,
    outdir,
    readback,
    schedule,
    sources,
)
from nondet.analysis import (
    Comparison,
    check_comparable,
    compare_pair,
    summary_of_capture,
    with_suggestions,
)
from nondet.errors import CaptureNotWritten, NondetError
from nondet.finding import concat, with_notes
from nondet.launch import CapturedRun
from nondet.live import Early, LiveCompare
from nondet.printable import LINE_MAX, clip
from nondet.recipe import Suggestion
from nondet.records import INIT_STEP
from nondet.repeatability import outcome, rows
from nondet.report import Report, RunSummary
from nondet.runspec import Plan, RunResult, Target
from nondet.schedule import InternalChildError  # noqa: F401 - re-exported
from nondet.store import Capture, open_capture

#: Steps with op-level recording in the first two runs (unless --ops all).
DEFAULT_OP_STEPS = [INIT_STEP, 0]


class ProgressSink(Protocol):
    """What the pipeline tells the user while it works (see nondet.progress)."""

    def stage(self, text: str) -> None: ...
    def status(self, text: str) -> None: ...


@dataclass
class Options:
    seed: int = 0
    out_dir: Path = Path(".nondet")
    ops_all: bool = False
    max_steps: int | None = None
    echo: bool = False  # show the script's own output
    schedule: str = "lockstep"  # or "sequential" (see nondet.schedule, default_schedule)
    apply: tuple[str, ...] = ()  # interventions applied to every run (nondet.interventions)
    verify: bool = False  # re-run with the suggested fixes applied (nondet.verify)
    budget: sources.Budget = field(default_factory=sources.Budget)  # every source's search
    early: Early | None = None  # narrowing runs started while the first pair ran


# -- running ---------------------------------------------------------------------------------
def _run_pair(target: Target, plans: tuple[Plan, Plan], options: Options,
              progress: ProgressSink, judge: schedule.Judge = schedule.never_stop,
              ) -> tuple[RunResult, RunResult]:
    """Two runs of the same script, as Options.schedule says (nondet.schedule).

    In lockstep both runs are held, still alive, when the judge stops them; the first
    finding is then located from the records already received, and both runs are asked
    for the outputs they kept of it, so the difference can be measured without running
    the script again. Sequentially, the second run is judged against the first as it goes.
    """
    return _schedule(target, options, progress).run_pair(plans, judge, on_hold=_fetch_kept)


def _pair_runner(target: Target, options: Options, progress: ProgressSink) -> narrow.RunPair:
    """``_run_pair`` for this target and options, for the re-runs of ``nondet.narrow``."""

    def run_pair(plans: tuple[Plan, Plan],
                 judge: schedule.Judge = schedule.never_stop) -> tuple[RunResult, RunResult]:
        return _run_pair(target, plans, options, progress, judge=judge)

    return run_pair


def _schedule(target: Target, options: Options, progress: ProgressSink) -> schedule.Schedule:
    return schedule.create(options.schedule, _run_factory(target, options), progress.status)


def _run_factory(target: Target, options: Options,
                 early: bool = True) -> Callable[[Plan], CapturedRun]:
    def make_run(plan: Plan) -> CapturedRun:
        taken = options.early.take(plan) if early and options.early else None
        run = taken or CapturedRun(target, plan, options.seed, options.out_dir,
                                   echo=options.echo,
                                   extra_env=interventions.environment(options.apply))
        if early and options.early and plan.label in ("a", "b"):
            options.early.watch(plan.label, run)  # the first pair (``_first``)
        return run

    return make_run


def _fetch_kept(a: schedule.Run, b: schedule.Run) -> None:
    """While both runs are held: ask each for the outputs it kept of the first finding."""
    position = _finding_position(a, b)
    if position is not None:
        for run in (a, b):
            run.request_kept(*position)


def _finding_position(a: schedule.Run, b: schedule.Run) -> tuple[int, int] | None:
    """(step, record index) of the first op or entry finding in the records received so far,
    by the same rule ``compare_captures`` applies to the files later."""
    limit = compare.first_step_divergence(np.array(a.steps), np.array(b.steps))
    steps = sorted(s for s in set(a.ops) & set(b.ops)
                   if limit is None or s <= limit.step)
    if not steps:
        return None
    ops_a = concat([np.concatenate(a.ops[s]) for s in steps])
    ops_b = concat([np.concatenate(b.ops[s]) for s in steps])
    found = compare.first_op_divergence(ops_a, ops_b, a.strings, b.strings)
    if found is None or found.kind not in ("op", "entry") or found.row_a is None:
        return None
    return int(found.row_a["step"]), int(found.row_a["index"])


def default_schedule() -> str:
    """Lockstep keeps both runs alive at once; on a GPU machine that doubles device memory,
    so there the runs go one after the other."""
    gpu = any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd"))
    return "sequential" if gpu else "lockstep"


def diagnose(target: Target, options: Options, progress: ProgressSink) -> Report:
    """``nondet run``: the whole pipeline (module docstring)."""
    if target.launcher is not None:  # a torchrun job: one capture per rank (nondet.jobs)
        return jobs.diagnose(target, options, progress)
    prepare(target, options)
    progress.stage(f"runs a and b of {target.describe()}, seed {options.seed}, "
                   f"compared step by step ({options.schedule})")
    # In lockstep a difference at a step without op records starts the narrowing runs at once
    lockstep = options.schedule == "lockstep"
    options.early = Early(_run_factory(target, options, early=False)) if lockstep else None
    judge = LiveCompare(progress, options.early.anticipate if options.early else None).judge
    try:
        result_a, result_b = _run_pair(target, (_first(options, "a"), _first(options, "b")),
                                       options, progress, judge=judge)
        return explain(target, options, progress, result_a, result_b)
    finally:
        if options.early is not None:
            options.early.discard()


def repeat(target: Target, options: Options, progress: ProgressSink, count: int) -> Report:
    """``--runs N``: N runs one after the other, a table of how each ended, and the diagnosis
    of the first run that differs from the first (N jobs, for a torchrun job)."""
    if target.launcher is not None:  # N torchrun jobs (nondet.job_runs)
        from nondet import job_runs  # it uses jobs, which this module imports

        return job_runs.repeat(target, options, progress, count)
    prepare(target, options)
    results = []
    runs = _schedule(target, options, progress)
    for i in range(1, count + 1):
        progress.stage(f"run {i} of {count}: {target.describe()}")
        # one schedule for all: each run's twin is the one before it (it ended), so a run
        # that computes for good long after is ended (schedule.Sequential.run_single)
        results.append(runs.run_single(_first(options, f"r{i}")))
    captures = [open_capture(r.path) for r in results]
    table = rows([r.label for r in results], [r.status for r in results],
                 [[outcome(r, c)] for r, c in zip(results, captures, strict=True)])
    differing = next((i for i in range(1, count)
                      if table[i].outcome != table[0].outcome
                      or compare.parted(captures[0].steps, captures[i].steps)),
                     None)
    suggestions: list[Suggestion] = []
    extra: list[str] = []
    if differing is None:
        found = compare_pair(captures[0], captures[1])
    else:
        progress.stage(f"run {differing + 1} differs from run 1: explaining")
        found, suggestions, extra = _explain(target, options, progress, captures[0],
                                             captures[differing])
    return found.report(runs=[_summary(r) for r in results], command=target.describe(),
                        captures=[str(c.path) for c in captures] + extra,
                        notes=[*(r.idle_note for r in results if r.idle_note),
                               *readback.report_notes([str(c.path) for c in captures] + extra)],
                        suggestions=suggestions, repeatability=table)


def write_baseline(target: Target, options: Options, progress: ProgressSink,
                   path: Path) -> tuple[int, int]:
    """Run once and store the step-level capture as the baseline: (steps, bytes)."""
    prepare(target, options)
    progress.stage(f"baseline run: {target.describe()}")
    result = _run_single(target, Plan("baseline", [], _first_plan(options)[1]), options,
                         progress)
    return result.steps, baseline.save(result.path, path)


def against_baseline(target: Target, options: Options, progress: ProgressSink,
                     path: Path, allow_drift: bool, allow_script_change: bool = False) -> Report:
    """Run once and compare with a stored baseline (step level)."""
    base = baseline.load(path)
    other_scheme = baseline.scheme_mismatch(base, environment.fingerprint_scheme())
    if other_scheme:
        raise NondetError(f"the baseline {path} was written with {other_scheme}: its "
                          "fingerprints cannot be compared with this run's; write it again "
                          "with --update-baseline")
    prepare(target, options)
    mismatch = baseline.script_mismatch(
        base, target.script, target.module,
        environment.script_digest(target.script) if target.script else "")
    if mismatch and not allow_script_change:
        raise NondetError(f"the baseline {path} is of a different script: {mismatch}; update it "
                          "with --update-baseline, or compare anyway with --allow-script-change")
    other_args = baseline.args_mismatch(base, target.module, list(target.args))
    if other_args and not allow_script_change:
        raise NondetError(f"the baseline {path} ran the script with other arguments: "
                          f"{other_args}; update it with --update-baseline, or compare anyway "
                          "with --allow-script-change")
    stored_seed = base.attrs.get("seed")
    if isinstance(stored_seed, int) and stored_seed != options.seed:
        # every value drawn differs from the first step: the comparison would say nothing
        raise NondetError(f"the baseline {path} was written with --seed {stored_seed}, and "
                          f"this check runs with --seed {options.seed}: pass --seed "
                          f"{stored_seed}, or update the baseline with --update-baseline")
    progress.stage(f"run: {target.describe()}, compared with the baseline {path}")
    result = _run_single(target, Plan("a", [], _first_plan(options)[1]), options, progress)
    current = open_capture(result.path)
    check_comparable(base, current)  # another framework: said before any drift
    drift = baseline.drift(base, current)
    if drift and not allow_drift:
        raise NondetError(
            f"the environment differs from the baseline in ways that void a bitwise "
            f"comparison: {baseline.describe_drift(drift)}; run where the baseline was made, "
            f"update it with --update-baseline, or compare anyway with --allow-env-drift")
    found = compare_pair(base, current)
    notes: list[str] = []
    if base.attrs.get("script_sha256") != current.attrs.get("script_sha256"):
        notes.append("the script has changed since the baseline was written")
    suggestions: list[Suggestion] = []
    if found.first_divergence is not None:
        found = replace(found, first_divergence=with_notes(
            found.first_divergence,
            f"compared with the baseline {path}; run `nondet run` on the script to see "
            "whether it is nondeterministic here and where",
            *(["possibly caused by the environment drift: " + baseline.describe_drift(drift)]
              if drift else [])))
        found, suggestions = with_suggestions(found, current)
    return found.report(runs=[summary_of_capture(base), _summary(result)],
                        captures=[str(base.path), str(current.path)],
                        command=target.describe(), notes=notes, suggestions=suggestions,
                        baseline=str(path), environment_drift=drift)


def _run_single(target: Target, plan: Plan, options: Options,
                progress: ProgressSink) -> RunResult:
    return _schedule(target, options, progress).run_single(plan)


def prepare(target: Target, options: Options) -> None:
    """Check the target and give this invocation a directory of its own under --out (the
    CLI makes it first; see nondet.outdir). Nothing already in --out is deleted."""
    if target.launcher is not None:
        raise NondetError(jobs.UNSUPPORTED)
    target.check()
    if not outdir.is_own(options.out_dir):
        options.out_dir = outdir.start(options.out_dir).path


def _first_plan(options: Options) -> tuple[list[int] | None, int | None]:
    """(op steps, stop after) of the runs that start a diagnosis."""
    op_steps = None if options.ops_all else DEFAULT_OP_STEPS
    return op_steps, options.max_steps - 1 if options.max_steps else None


def _first(options: Options, label: str) -> Plan:
    """A run that starts a diagnosis; its default op window may be declined by a framework
    for which it would cost the whole run (TensorFlow: ``ChildConfig.ops_optional``)."""
    op_steps, stop_after = _first_plan(options)
    return Plan(label, op_steps, stop_after, ops_optional=op_steps is not None)


def explain(target: Target, options: Options, progress: ProgressSink, result_a: RunResult,
            result_b: RunResult) -> Report:
    """Compare two finished runs; narrow down, measure and explain what differs."""
    a, b = open_capture(result_a.path), open_capture(result_b.path)
    found, suggestions, extra = _explain(target, options, progress, a, b)
    if options.early is not None:
        options.early.discard()  # the narrowing took what it could use
    every: list[sources.Source] = []
    combined = None
    if options.verify and found.first_divergence is not None and suggestions:
        from nondet.rerun import PipelineSteps  # it uses this module's steps

        steps = PipelineSteps(target, options, progress)
        div = found.first_divergence
        try:
            suggestions, written = steps.verify((), options.out_dir, suggestions, (a, b),
                                                INIT_STEP if div.step is None else div.step)
            extra += written
            first = sources.Source(div, suggestions)
            every, combined, written = sources.every_source(
                first, (a, b), steps, options.out_dir, options.budget, progress.stage,
                whole_script=result_a.status == result_b.status == "complete")
            extra += written
        except CaptureNotWritten as exc:  # the finding stands; its fixes were not proved
            found = replace(found, notes=[*found.notes, f"the fixes were not verified: {exc}"])
    report = found.report(runs=[_summary(r) for r in (result_a, result_b)],
                          captures=[str(a.path), str(b.path), *extra],
                          command=target.describe(), suggestions=suggestions,
                          notes=[*(r.idle_note for r in (result_a, result_b) if r.idle_note),
                                 *readback.report_notes(extra)])
    report.sources, report.combined_fix = every, combined
    return report


def _explain(target: Target, options: Options, progress: ProgressSink, a: Capture,
             b: Capture) -> tuple[Comparison, list[Suggestion], list[str]]:
    """The comparison of two captures with its finding narrowed down and measured, the
    recipes for it, and the captures the extra runs wrote."""
    found = compare_pair(a, b)
    div = found.first_divergence
    if div is None or (div.kind == "structure" and not div.localized):
        return found, [], []
    if div.process is not None:  # found in a child's own capture: no re-runs aim at it
        return (*with_suggestions(found, a), [])

    extra: list[str] = []
    op_capture, op_capture_b = a, b
    step_div = compare.first_step_divergence(a.steps, b.steps)
    # Data named from the step rows alone (it entered at a step the op window did not cover)
    # may not say where it entered; the op records of that step always do.
    unplaced_entry = div.kind == "entry" and div.op_index is None and not div.source
    # A first pair's framework may also have declined step 0 of its op window (``_first``).
    covered = narrow.op_steps_of(a)
    run_pair = _pair_runner(target, options, progress)
    # The end state of a step differed where no op of it did (every op of a recorded step
    # matched; only the RNG state of another differs: a thread drew from the generator after
    # the step's last op): the next step reads that state, so it is recorded too.
    read_next = (not div.localized and step_div is not None and not step_div.structural
                 and (covered is None or step_div.step + 1 not in covered)
                 and (step_div.step in (covered or ()) or compare.state_only(step_div.fields)))
    if (not div.localized or unplaced_entry) and step_div is not None and (
            step_div.step >= 1 or (covered is not None and step_div.step not in covered)
            or read_next):
        try:
            narrowed, written = narrow.narrow(run_pair, progress.stage, step_div.step,
                                              lockstep=options.schedule == "lockstep",
                                              read_next=read_next)
        except CaptureNotWritten as exc:  # the first pair's finding stands: say why alone
            return (*with_suggestions(replace(found, first_divergence=with_notes(
                div, f"the op-level re-runs were stopped ({exc}): this is what the first "
                "two runs' records say; free space and run again to find the op")), a), [])
        extra += written
        if narrowed is None and a.facts.get("capture_note.steps_per_execution"):
            div = with_notes(
                div, f"the op-level re-runs did not place the difference at step "
                f"{step_div.step}: it entered inside a traced call of several steps "
                "(steps_per_execution > 1), whose op records are its first step's")
        elif narrowed is None:
            div = with_notes(
                div, f"the difference at step {step_div.step} did not recur in the op-level "
                "re-runs: it is rare or timing-dependent; try `nondet run --ops all` to capture "
                "every op in the first two runs")
        else:
            div, op_capture, op_capture_b = narrowed

    if div.localized and div.kind in ("op", "entry") and div.op_index is not None:
        try:
            div, written = narrow.measured(run_pair, progress.stage, div, op_capture,
                                           op_capture_b)
        except CaptureNotWritten as exc:
            div, written = with_notes(div, f"sizes not measured: {exc}"), []
        extra += written
    if (div.step is None or div.step <= 0) and not (div.kind == "op" and div.explained):
        _check_same_start(a, b)  # after the narrowing: a race found there is the finding
    found = replace(found, first_divergence=div)
    return (*with_suggestions(found, a), extra)


def _check_same_start(a: Capture, b: Capture) -> None:
    """Runs that parted at their start where one of them read a file the other had written
    before it started (``--schedule sequential``: run b resumed from run a's checkpoint) did
    not start from the same state: their difference is the file's, not nondeterminism, and
    a cause named from it (an RNG, a seed the script sets) would be wrong. Exit 2, saying
    why. Runs that part later, or at an op whose inputs matched (a race: whatever the file
    held, both runs computed from the same values), keep their finding and the note: a
    data set run a downloaded, a cache it built from a seed, holds the same bytes for run
    b."""
    for capture, other in ((a, b), (b, a)):
        prefix = f"capture_note.{readback.FACT}:"
        read = [key[len(prefix):] for key in capture.facts if key.startswith(prefix)]
        if read:
            raise NondetError(
                f"the runs differ, but run {capture.label} read {clip(read[0], LINE_MAX)}, "
                f"which run {other.label} of this nondet invocation wrote before it started: "
                "the script resumes from or reuses what it finds, so the runs did not start "
                "alike (other code ran, or from other values) and the first difference is the "
                "file's, not nondeterminism; "
                "run nondet in the default lockstep schedule (both runs start before either "
                "writes it), or point the script's output elsewhere, and delete the file "
                "before running nondet again")


# -- summaries -----------------------------------------------------------------------------------
def _summary(result: RunResult) -> RunSummary:
    return RunSummary(path=str(result.path), exit_code=result.exit_code, steps=result.steps,
                      complete=result.complete, status=result.status, label=result.label,
                      final_params_fp=result.final.get("final_params_fp"))

