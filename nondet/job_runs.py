"""``--runs N`` on a torchrun job: N whole jobs one after the other, the repeatability table
(one row per job: jobs share a letter only if every rank ended identically), and the
diagnosis of the first job that differs from the first, compared rank by rank and
narrowed down as ``run`` does (``job_narrow.explain``). As for one process, its fixes are
not verified (``nondet run`` without --runs does that)."""

from __future__ import annotations

from nondet import compare, job_narrow, repeatability
from nondet.distributed import JobResult
from nondet.jobrun import run_checked
from nondet.jobs import (
    Options,
    ProgressSink,
    build_report,
    first_plan,
    rank_results,
    start,
)
from nondet.report import Report
from nondet.runspec import Plan, Target
from nondet.store import open_capture


def repeat(target: Target, options: Options, sink: ProgressSink, count: int) -> Report:
    start(target, options)
    op_steps, stop_after = first_plan(options)
    results: list[JobResult] = []
    for i in range(1, count + 1):
        sink.stage(f"job {i} of {count}: {target.describe()}")
        results.append(run_checked(target, Plan(f"r{i}", op_steps, stop_after=stop_after),
                                   options.seed, options.out_dir, options.apply,
                                   options.echo))
    table = repeatability.rows(
        [job.label for job in results],
        [next((r.status for r in job.ranks if not r.complete), "complete") for job in results],
        [_outcomes(job) for job in results])
    differing = next((i for i in range(1, count) if table[i].outcome != table[0].outcome
                      or _steps_differ(results[0], results[i])), None)
    if differing is not None:
        sink.stage(f"job {differing + 1} differs from job 1: explaining")
    other = results[differing if differing is not None else 1]
    found, suggestions, written = job_narrow.explain(
        target, options, sink.stage, (results[0], other), options.out_dir, options.apply)
    return build_report(found, suggestions, results, target.describe(), written,
                        repeatability=table)


def _outcomes(job: JobResult) -> list[repeatability.Outcome]:
    """Each rank's outcome, in rank order."""
    by_rank = sorted(job.ranks, key=lambda r: int(r.label.rsplit("rank", 1)[1]))
    return [repeatability.outcome(r, open_capture(r.path)) for r in by_rank]


def _steps_differ(a: JobResult, b: JobResult) -> bool:
    return any(compare.parted(open_capture(ra.path).steps,
                              open_capture(rb.path).steps) is not None
               for ra, rb in rank_results(a, b).values())
