"""Running one job of a diagnosis and checking how it ended.

``run_checked`` runs one torchrun job (``distributed.Job``) with the given fixes applied
and returns it only if every rank ended well; otherwise the error names the run and the
rank: the one that ended first among those that failed or were killed (the others fail
after it in a collective, or are ended by torchrun), or the silent ranks that got least
far when the job was ended for silence.

A job ended for silence is ``JobHung``, not ``ScriptFailed``: fix verification treats a
script that fails with a fix applied as "the fix did not help" and goes on, but a hang is
never an answer about the fix; it ends the invocation (exit 2) whichever run it was in.
"""

from __future__ import annotations

from pathlib import Path

from nondet import channel, interventions
from nondet.distributed import STALL_AFTER, Job, JobResult
from nondet.errors import CaptureNotWritten, NondetError, ScriptFailed
from nondet.runspec import Plan, Target, log_tail
from nondet.schedule import InternalChildError, exception_line


class JobHung(NondetError):
    """A job was ended because its ranks went silent (exit 2, naming run and ranks)."""


def run_checked(target: Target, plan: Plan, seed: int, out_dir: Path,
                apply: tuple[str, ...] = (), echo: bool = False,
                stall_after: float = STALL_AFTER) -> JobResult:
    """One job (``run-<label>/`` in ``out_dir``) with the interventions ``apply`` reaching
    every rank through the environment torchrun passes on; checked (``check_job``)."""
    job = Job(target, plan, seed, out_dir, extra_env=interventions.environment(apply),
              echo=echo, stall_after=stall_after)
    return check_job(job.run())


def check_job(job: JobResult) -> JobResult:
    """The job if every rank ended well, else the error naming the run and the rank."""
    for result in job.ranks:
        if result.write_error:
            raise CaptureNotWritten(result.write_error + "; the runs were stopped")
    for result in job.ranks:
        if result.hook_error:
            raise InternalChildError(result.hook_error)
    by_rank = {int(r.label.rsplit("rank", 1)[1]): r for r in job.ranks}
    if job.stalled and not job.hung:
        raise JobHung(
            f"run {job.label}: no rank reached nondet or sent anything for "
            f"{job.silence:.0f} s (torchrun waiting for its rendezvous, or the ranks for "
            f"each other?); the job was ended. Its output is in {job.log_path}",
            details=_tail(job.log_path))
    if job.hung:
        names = ", ".join(str(r) for r in job.hung)
        steps = min((by_rank[r].steps for r in job.hung if r in by_rank), default=0)
        silent = (f"sent nothing for {job.silence:.0f} s" if job.stalled
                  else "went on after torchrun had exited")
        raise JobHung(
            f"run {job.label}: rank{'s' if len(job.hung) > 1 else ''} {names} {silent}, "
            f"after {steps} step(s) (a rank hangs, or waits in a collective for one that "
            f"does); the job was ended. Its output is in {job.log_path}",
            details=_tail(job.log_path))
    # The rank that ended first: the others fail after it (a collective with a dead peer
    # raises) or are ended by torchrun.
    failed = [by_rank[r] for r in job.ended_first
              if by_rank[r].status in (channel.FAILED, channel.CRASHED)]
    if failed:
        first = failed[0]
        rank = first.label.rsplit("rank", 1)[1]
        how = (f"exit code {first.exit_code}" if first.status == channel.FAILED
               else "it ended without a word: killed by a signal?")
        last = exception_line(first.error)
        raise ScriptFailed(f"the script failed in run {job.label}, rank {rank} ({how})"
                           + (f": {last}" if last else "")
                           + f"; the job's output is in {job.log_path}",
                           details=first.error or _tail(job.log_path))
    if job.world_size and len(job.ranks) < job.world_size and not job.multi_node:
        raise ScriptFailed(f"run {job.label}: only {len(job.ranks)} of {job.world_size} ranks "
                           f"reached nondet (the others may run on another node); the job's "
                           f"output is in {job.log_path}")
    if not job.ranks:
        raise ScriptFailed(f"run {job.label}: torchrun exited with code {job.agent_exit_code} "
                           f"before any rank started; its output is in {job.log_path}",
                           details=_tail(job.log_path))
    return job


def _tail(path: Path, lines: int = 15) -> str:
    return log_tail(path, lines)

