"""``nondet run`` on a distributed job: two whole jobs, compared rank by rank.

Runs a and b are two torchrun jobs one after the other (``jobrun.run_checked``): N ranks
at once already share the machine's cores, and a job cannot be stopped part-way at the
same step on every rank without the others blocking in a collective, so each job runs to
its end (or to ``--max-steps``, which every rank reaches at the same step boundary). Its
suggested fixes are verified on two more jobs each (``job_fixes``); ``--runs N`` is
``job_runs``.

Rank i of run a is compared with rank i of run b by the single-process rules
(``analysis.compare_pair``). The finding is the earliest one over the ranks; at the same
step, an op that created a difference on its own rank (its inputs matched) wins over a
collective whose output differs: a collective's inputs on one rank may match while another
rank fed it the difference (DDP's gradient all-reduce carries rank 1's racing backward to
rank 0). Ties go to the lower rank. The finding's ``rank`` says where it is.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np

from nondet import outdir
from nondet.analysis import Comparison, compare_pair, with_suggestions
from nondet.collective import as_collective, is_collective
from nondet.distributed import JobResult
from nondet.errors import NondetError
from nondet.exitcodes import ExitCode
from nondet.finding import with_notes
from nondet.frameworks.torch.comm import ENTRY_PREFIX
from nondet.jobrun import run_checked
from nondet.recipe import Suggestion
from nondet.records import INIT_STEP, STEP_COMPONENTS, Kind, Phase
from nondet.report import Divergence, RepeatRow, Report, RunSummary, Source
from nondet.runspec import Plan, RunResult, Target
from nondet.sources import Budget
from nondet.store import Capture, open_capture


class Options(Protocol):
    """What a job's diagnosis reads of ``pipeline.Options`` (pipeline imports this module,
    not the other way round)."""

    seed: int
    out_dir: Path
    ops_all: bool
    max_steps: int | None
    echo: bool
    apply: tuple[str, ...]
    verify: bool
    budget: Budget


class ProgressSink(Protocol):
    def stage(self, text: str) -> None: ...


UNSUPPORTED = ("--baseline is not available for torchrun jobs: compare two jobs with "
               "`nondet check torchrun ...` (or N jobs with --runs N)")


def diagnose(target: Target, options: Options, sink: ProgressSink) -> Report:
    """``nondet run torchrun ...``: both jobs, the per-rank comparison (narrowed down:
    ``job_narrow``), and with ``options.verify`` the suggested fixes verified on two more
    jobs each (``job_fixes``)."""
    start(target, options)
    op_steps, stop_after = first_plan(options)
    first: list[JobResult] = []
    for label in ("a", "b"):
        sink.stage(f"run {label}: {target.describe()}, seed {options.seed}")
        first.append(run_checked(target, Plan(label, op_steps, stop_after=stop_after),
                                 options.seed, options.out_dir, options.apply, options.echo))
    from nondet import job_fixes, job_narrow  # they use this module

    found, suggestions, written = job_narrow.explain(
        target, options, sink.stage, (first[0], first[1]), options.out_dir, options.apply)
    every: list[Source] = []
    combined = None
    div = found.first_divergence
    if options.verify and div is not None and suggestions:
        suggestions, every, combined, more = job_fixes.verify_finding(
            target, options, sink.stage, (first[0], first[1]), div, suggestions)
        written += more
    report = build_report(found, suggestions, first, target.describe(), written)
    report.sources, report.combined_fix = every, combined
    return report


def start(target: Target, options: Options) -> None:
    """Check the target; give this invocation its own directory under --out."""
    target.check()
    if not outdir.is_own(options.out_dir):
        options.out_dir = outdir.start(options.out_dir).path


def first_plan(options: Options) -> tuple[list[int] | None, int | None]:
    """(op steps, stop after) of the jobs that start a diagnosis."""
    return (None if options.ops_all else [INIT_STEP, 0],
            options.max_steps - 1 if options.max_steps else None)


def diff_dirs(dir_a: Path, dir_b: Path) -> Report:
    """``nondet diff DIR DIR``: two run directories of a job (``run-a/``, ``run-b/``, each
    holding ``rank<R>.h5``), compared rank by rank as ``run`` does."""
    return _report(_job_of_dir(dir_a), _job_of_dir(dir_b), f"diff {dir_a} {dir_b}")


def _job_of_dir(path: Path) -> JobResult:
    files = sorted(path.glob("rank*.h5"))
    if not files:
        raise NondetError(f"{path} holds no rank<R>.h5 capture: give two run directories of "
                          "a torchrun job (run-a/, run-b/) or two .h5 files")
    ranks = []
    for file in files:
        capture = open_capture(file)
        capture.verify()  # untrusted: damage is exit 2, never a verdict
        rank = int(capture.attrs.get("rank", 0))
        if file.name != f"rank{rank}.h5":
            raise NondetError(f"{file} holds rank {rank}'s capture: rename it rank{rank}.h5")
        ranks.append(RunResult(label=f"{path.name}/rank{rank}", path=file, log_path=file,
                               status=str(capture.attrs.get("status", "")),
                               exit_code=int(capture.attrs.get("exit_code", -1)),
                               steps=capture.n_steps))
    return JobResult(label=path.name, ranks=ranks, agent_exit_code=0, log_path=path)


def _report(job_a: JobResult, job_b: JobResult, command: str) -> Report:
    """Two finished jobs compared (no re-runs: ``diff``)."""
    found, rank = compare_jobs(job_a, job_b)
    suggestions: list[Suggestion] = []
    if found.first_divergence is not None:
        found, suggestions = with_suggestions(found, open_capture(rank_path(job_a, rank)))
    return build_report(found, suggestions, [job_a, job_b], command)


def build_report(found: Comparison, suggestions: list[Suggestion], jobs: list[JobResult],
                 command: str, extra: list[str] | None = None,
                 repeatability: list[RepeatRow] | None = None) -> Report:
    """The one Report of a job's diagnosis: every rank's capture is a run."""
    runs = [RunSummary(path=str(r.path), exit_code=r.exit_code, steps=r.steps,
                       complete=r.complete, status=r.status, label=r.label,
                       final_params_fp=r.final.get("final_params_fp"))
            for job in jobs for r in job.ranks]
    return found.report(runs=runs, captures=[s.path for s in runs] + (extra or []),
                        command=command, suggestions=suggestions,
                        repeatability=repeatability or [])


def rank_results(a: JobResult, b: JobResult) -> dict[int, tuple[RunResult, RunResult]]:
    """Rank R's result in job a and in job b, for every rank (both jobs must have the same)."""
    ranks_a = {_rank_of(r.label): r for r in a.ranks}
    ranks_b = {_rank_of(r.label): r for r in b.ranks}
    if set(ranks_a) != set(ranks_b):
        raise NondetError(f"the two runs had different ranks ({sorted(ranks_a)} and "
                          f"{sorted(ranks_b)}): nothing to compare rank by rank")
    return {r: (ranks_a[r], ranks_b[r]) for r in sorted(ranks_a)}


def compare_jobs(a: JobResult, b: JobResult) -> tuple[Comparison, int]:
    """The comparison of the two jobs and the rank of its finding (module docstring)."""
    caps = {r: (open_capture(ra.path), open_capture(rb.path))
            for r, (ra, rb) in rank_results(a, b).items()}
    per_rank = {r: compare_captures_of_rank(*caps[r], r) for r in caps}
    for r, c in per_rank.items():
        div = c.first_divergence
        # Any other rank that differs by then on its own account (an op, data, a seed: not
        # a collective's output) may have fed the collective: then it is not the cause.
        made_here = any(_own_difference(o.first_divergence, caps[q][0])
                        and _step_of(o.first_divergence) <= _step_of(div)
                        for q, o in per_rank.items() if q != r)
        collective = None if made_here else as_collective(div, r, caps)
        if collective is not None:
            per_rank[r] = replace(c, first_divergence=collective)
    found = [(r, c) for r, c in per_rank.items() if c.first_divergence is not None]
    drift = first_desync({r: ca for r, (ca, _) in caps.items()}, a.label) or \
        first_desync({r: cb for r, (_, cb) in caps.items()}, b.label)
    if drift is not None and (not found or all(
            _step_of(drift[1]) < _step_of(c.first_divergence) for _, c in found)):
        rank = drift[0]
        base = per_rank[min(per_rank)]
        return replace(base, verdict="nondeterministic", exit_code=ExitCode.NONDETERMINISTIC,
                       first_divergence=drift[1]), rank
    if not found:
        return per_rank[min(per_rank)], min(per_rank)
    rank, chosen = min(found, key=lambda rc: _order(rc[0], rc[1].first_divergence))
    div = chosen.first_divergence
    assert div is not None
    if div.step is not None:
        div = with_notes(div, phase_table(caps, div.step))
    others = [f"rank {r}: {_describe(c.first_divergence)}" for r, c in found if r != rank]
    if others:
        div = with_notes(div, "the other ranks' first differences: " + "; ".join(others))
    return replace(chosen, first_divergence=div), rank


def compare_captures_of_rank(a: Capture, b: Capture, rank: int) -> Comparison:
    found = compare_pair(a, b)
    if found.first_divergence is None:
        return found
    world = int(a.attrs.get("world_size", 1))
    return replace(found, first_divergence=replace(found.first_divergence, rank=rank,
                                                   world_size=world))


#: Columns of the rank x phase table, in the order a step runs.
_PHASES = (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.COMM, Phase.OPTIMIZER)


def phase_table(caps: dict[int, tuple[Capture, Capture]], step: int) -> str:
    """Where runs a and b agree at ``step``, rank by rank and phase by phase: the step
    rows' fields (``records.STEP_COMPONENTS``) and, with op records, the records of each
    phase (comm has op records only)."""
    lines = [f"runs a and b at step {step}, rank x phase (= same, x differs, . not seen): "
             + " ".join(p.label for p in _PHASES)]
    for rank, (a, b) in sorted(caps.items()):
        row_a = next((r for r in a.steps if int(r["step"]) == step), None)
        row_b = next((r for r in b.steps if int(r["step"]) == step), None)
        marks = []
        for phase in _PHASES:
            seen, differs = False, False
            if row_a is not None and row_b is not None:
                for name, where in STEP_COMPONENTS:
                    if where == phase and (int(row_a[name]) or int(row_b[name])):
                        seen = True
                        differs = differs or int(row_a[name]) != int(row_b[name])
            ops_a = [r for r in a.ops(step) if _phase_of(a, r) == phase]
            ops_b = [r for r in b.ops(step) if _phase_of(b, r) == phase]
            if ops_a or ops_b:
                seen = True
                differs = differs or len(ops_a) != len(ops_b) or any(
                    int(x["out_fp"]) != int(y["out_fp"]) or int(x["in_fp"]) != int(y["in_fp"])
                    for x, y in zip(ops_a, ops_b, strict=False))
            marks.append("x" if differs else "=" if seen else ".")
        lines.append(f"rank {rank}: " + " ".join(marks))
    return "; ".join(lines)


def _phase_of(capture: Capture, row: np.void) -> int:
    """A record's phase; a collective's output, read afresh later, counts as comm."""
    if int(row["kind"]) == Kind.ENTRY and capture.string(int(row["name"])).startswith(
            ENTRY_PREFIX):
        return int(Phase.COMM)
    return int(row["phase"])


def first_desync(caps: dict[int, Capture], label: str) -> tuple[int, Divergence] | None:
    """Replica desync within one run: the first step after which a rank's parameters
    differ from rank 0's, when they matched after the step before (or at init). Ranks
    whose parameters differ from the start hold shards (model parallel, FSDP), not
    replicas: never a desync."""
    if len(caps) < 2 or 0 not in caps:
        return None
    rows = {r: {int(row["step"]): int(row["params_fp"]) for row in c.steps}
            for r, c in caps.items()}
    world = len(caps)
    drifts: list[tuple[int, int, int]] = []  # (step, rank, step before)
    for rank in sorted(caps):
        common = sorted(set(rows[0]) & set(rows[rank]))
        drifts += [(step, rank, before) for before, step in itertools.pairwise(common)
                   if rows[0][before] == rows[rank][before]
                   and rows[0][step] != rows[rank][step]]
    if not drifts:
        return None
    step, rank, before = min(drifts)
    return rank, Divergence(
        kind="desync", step=step, phase="optimizer", rank=rank, world_size=world,
        step_fields=["params"],
        notes=[f"replica desync in run {label}: rank {rank}'s parameters differ from rank 0's "
               f"after step {step} (they matched after "
               f"{'init' if before == INIT_STEP else f'step {before}'}); DDP keeps replicas "
               "equal only through their gradients: a parameter changed outside them (an "
               "update on one rank, an unsynchronized parameter or buffer) drifts"])


def _own_difference(div: Divergence | None, capture: Capture) -> bool:
    """Did this rank's first difference arise on this rank (not read from a collective)?"""
    if div is None:
        return False
    if div.kind == "entry" and div.step is not None and div.op_index is not None:
        names = [capture.string(int(r["name"])) for r in capture.ops(div.step)
                 if int(r["index"]) == div.op_index]
        return not (names and names[0].startswith(ENTRY_PREFIX))
    return not is_collective(div.op) and div.kind != "collective"


def _step_of(div: Divergence | None) -> int:
    if div is None or div.step is None:
        return INIT_STEP if div is not None else 1 << 30
    return div.step


def _order(rank: int, div: Divergence | None) -> tuple[int, int, int, int]:
    assert div is not None
    step = INIT_STEP if div.step is None else div.step
    # Anything but an op that made the difference from matching inputs may have been
    # carried in from another rank: a collective, an op whose inputs differed with no
    # recorded cause, a value read afresh after a collective (an entry).
    carried = int(div.kind not in ("op", "collective") or (is_collective(div.op)
                  and div.kind != "collective") or not div.explained)
    return (step, carried, div.op_index if div.op_index is not None else 1 << 30, rank)


def _describe(div: Divergence | None) -> str:
    if div is None:
        return "none"
    step = "init" if div.step is None else f"step {div.step}"
    return f"{step}, {div.phase}" + (f": {div.op}" if div.op else "")


def _rank_of(label: str) -> int:
    return int(label.rsplit("rank", 1)[1])


def rank_path(job: JobResult, rank: int) -> Path:
    return next(r.path for r in job.ranks if _rank_of(r.label) == rank)
