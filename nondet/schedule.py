"""How two recorded runs share the machine: in lockstep, or one after the other.

A schedule starts the runs of a pair (two ``Plan``s of the same script), shows a judge
each step once both runs have it (the judge returns False to stop them), and returns both
results, checked (``check_result``): a script that failed, a hook that failed, a capture
that could not be written become the one error the user sees.

Never waiting for nothing: a run in lockstep waits for nondet's word after each step,
and a finished one that kept op outputs waits for it in ``Session.finish``. Every state of
the two runs leads to that word: a run that ends (on its own, failing, killed) frees the
other; whenever the runs are told to stop, every run is told, ended or not; a hold always
ends with a release; a run that makes no progress while the other waits for it frees
both (they may be waiting on each other: a lock, a port, a directory); and a run that
does not exit once it has ended or been told to stop is ended by signal after a grace
period. nondet then only ever waits for a script that is computing, and not for long
once the other run has ended: a run that then goes without a frame several times longer
than its twin ever went quietly (a loop that never ends in one run only) is ended too
(``CapturedRun.end_if_outlived``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from nondet import channel, errors, idle, importpath, run_collisions, runspec
from nondet.errors import CaptureNotWritten, NondetError, ScriptFailed, Terminated
from nondet.printable import LINE_MAX, clip
from nondet.runspec import Plan, RunResult
from nondet.turns import MAX_GRANT, TURN_SECONDS, Turns
from nondet.turns import Judge as Judge  # re-exported: the judge of every schedule

#: Lockstep runs keep host copies of op outputs up to this size, to measure a difference.
KEEP_BYTES = 256 << 20
#: A run whose twin has ended is ended after this long without a frame at least
#: (``outlived_floor``), and after 5 x the twin's longest quiet spell (``idle.IdleWatch``).
OUTLIVED_FLOOR = 60.0

StatusSink = Callable[[str], None]


class Run(Protocol):
    """What a schedule needs of a run: ``launch.CapturedRun``, or a fake in tests."""

    plan: Plan
    on_step: Callable[[Any, np.void], None] | None
    on_end: Callable[[Any], None] | None
    steps: list[np.void]
    ops: dict[int, list[np.ndarray]]
    strings: list[str]

    @property
    def ended(self) -> bool: ...

    def start(self) -> None: ...

    def send_control(self, message: bytes) -> None: ...

    def request_stop(self) -> None: ...

    def request_kept(self, step: int, index: int, timeout: float = ...
                     ) -> list[np.ndarray] | None: ...

    def wait(self, timeout: float | None = None) -> RunResult: ...

    def cancel(self) -> None: ...

    def interrupt(self, forward: bool = False) -> RunResult: ...

    def end_if_idle(self) -> bool: ...

    def end_if_outlived(self, twin: Any, floor: float) -> bool: ...


RunFactory = Callable[[Plan], Run]
#: Called while both lockstep runs are held after the judge stopped them (both alive,
#: waiting): the place to ask them for the outputs they kept (``Run.request_kept``).
OnHold = Callable[[Run, Run], None]


def never_stop(step: int, row_a: np.void | None, row_b: np.void | None) -> bool:
    return True


class Schedule(Protocol):
    name: str

    def run_pair(self, plans: tuple[Plan, Plan], judge: Judge = never_stop,
                 on_hold: OnHold | None = None) -> tuple[RunResult, RunResult]: ...

    def run_single(self, plan: Plan) -> RunResult: ...


def create(name: str, make_run: RunFactory, status: StatusSink | None = None) -> Schedule:
    """The schedule called ``name`` ("lockstep" or "sequential")."""
    if name == "lockstep":
        return Lockstep(make_run, status)
    if name == "sequential":
        return Sequential(make_run, status)
    raise NondetError(f"unknown schedule {name!r}: use lockstep or sequential")


class _SingleRuns:
    """``run_single`` of a schedule: a run alone, whose twin is the single run before it
    (``--runs N``: a run that computes for good after the earlier ones ended is ended)."""

    make_run: RunFactory
    status: StatusSink | None
    last: Run | None = None  # the run run_single ran last (ended)

    def run_single(self, plan: Plan) -> RunResult:
        run = self.make_run(plan)
        result = _run_alone(run, self.status, twin=self.last)
        self.last = run
        return check_result(result)


class Sequential(_SingleRuns):
    """One run after the other; the second is judged against the first as it goes."""

    name = "sequential"

    def __init__(self, make_run: RunFactory, status: StatusSink | None = None) -> None:
        self.make_run = make_run
        self.status = status


    def run_pair(self, plans: tuple[Plan, Plan], judge: Judge = never_stop,
                 on_hold: OnHold | None = None) -> tuple[RunResult, RunResult]:
        first = self.make_run(plans[0])
        result_first = check_result(_run_alone(first, self.status))
        reference = {int(r["step"]): r for r in first.steps}
        second = self.make_run(plans[1])

        def against_first(run: Run, row: np.void) -> None:
            step = int(row["step"])
            _report_step(self.status, run, row)
            if not judge(step, reference.get(step), row):
                run.request_stop()

        second.on_step = against_first
        return result_first, check_result(_run_alone(second, None, twin=first))


def outlived_floor() -> float:
    """The least time a run goes without a frame before it counts as having outlived its
    twin (``CapturedRun.end_if_outlived``): a minute, or the idle limit if shorter."""
    return min(OUTLIVED_FLOOR, idle.idle_after())


def _run_alone(run: Run, status: StatusSink | None, twin: Run | None = None) -> RunResult:
    """``twin``: a run of the same script that went before and ended (the first of a
    sequential pair, the previous of ``--runs N``)."""
    if run.on_step is None and status is not None:
        run.on_step = lambda r, row: _report_step(status, r, row)
    run.start()
    try:
        while True:  # a run alone never waits for nondet: this is the script's time ...
            try:
                return run.wait(timeout=1.0)
            except TimeoutError:
                # ... unless it does nothing at all (nondet.idle), or goes on quietly far
                # longer than its twin ever did
                if not run.end_if_idle() and twin is not None:
                    run.end_if_outlived(twin, outlived_floor())
    except (KeyboardInterrupt, Terminated) as exc:
        run.interrupt(forward=isinstance(exc, Terminated))
        raise


def _report_step(status: StatusSink | None, run: Run, row: np.void) -> None:
    if status is not None and int(row["step"]) >= 0:
        status(f"run {run.plan.label}: step {int(row['step'])}")


class Lockstep(_SingleRuns):
    """Both runs at once, taking turns one step each (see docs/architecture.md).

    Only one run computes at a time, so neither slows the other down, yet they start
    together (imports and set-up overlap) and both stop as soon as the answer is known.
    Short steps are granted several to a turn (``turns.Grants``: a turn of at least
    ``turn_seconds``, at most ``max_grant`` steps; ``max_grant=1``: one step a turn).
    Runs that both ask for it compute their first step at once (``Turns._advance``).
    With ``on_hold``, runs the judge stops are held alive at that step until ``on_hold``
    has returned (it may ask them for the outputs they kept), then stopped.
    """

    name = "lockstep"

    def __init__(self, make_run: RunFactory, status: StatusSink | None = None, *,
                 keep_bytes: int = KEEP_BYTES, stall_after: float = 60.0,
                 stall_factor: float = 5.0, exit_grace: float = 120.0,
                 poll: float = 0.2, turn_seconds: float = TURN_SECONDS,
                 max_grant: int = MAX_GRANT) -> None:
        self.make_run = make_run
        self.status = status
        self.keep_bytes = keep_bytes
        # A run that sends nothing for max(stall_after, stall_factor x the slowest step so
        # far) while the other waits for it frees both (see the module docstring).
        self.stall_after = stall_after
        self.stall_factor = stall_factor
        self.exit_grace = exit_grace  # for a run to exit once ended or told to stop
        self.poll = poll
        self.turn_seconds = turn_seconds
        self.max_grant = max_grant


    def run_pair(self, plans: tuple[Plan, Plan], judge: Judge = never_stop,
                 on_hold: OnHold | None = None) -> tuple[RunResult, RunResult]:
        keep = self.keep_bytes if on_hold is not None else 0
        a, b = (self.make_run(replace(plan, lockstep=True,
                                      keep_bytes=0 if plan.dump else keep))
                for plan in plans)
        turns = Turns(a, b, judge, hold=on_hold is not None, turn_seconds=self.turn_seconds,
                      max_grant=self.max_grant)
        started: list[Run] = []
        try:
            for run in (a, b):
                run.start()
                started.append(run)
            while not turns.done.wait(self.poll):
                if any(getattr(run, "unsupported", "") for run in (a, b)):
                    # the script does what nondet cannot record (a thread waits for a turn
                    # that its stopped sibling will never take): end both; check_result says why
                    turns.stop_all()
                if turns.stalled(time.monotonic(), self.stall_after, self.stall_factor):
                    turns.free_all()
                for run, twin in ((a, b), (b, a)):
                    if not turns.makes_wait(run):
                        # it ends: on_end frees the other one
                        run.end_if_idle() or run.end_if_outlived(twin, outlived_floor())
            try:
                if turns.holding and on_hold is not None:
                    on_hold(a, b)
            finally:
                turns.release()  # whatever happened, no run is left waiting for a word
            # one grace for both: two runs that hang at exit waited one after the other
            deadline = time.monotonic() + self.exit_grace
            results = (self._collect(a, deadline), self._collect(b, deadline))
        except BaseException as exc:
            # Ctrl-C reached the children too; anything else (SIGTERM, a bug) did not.
            _interrupt_all(started, forward=not isinstance(exc, KeyboardInterrupt))
            raise
        try:
            return check_result(results[0]), check_result(results[1])
        except ScriptFailed as exc:
            failed = [r for r in results if r.status in (channel.FAILED, channel.CRASHED)]
            if len(failed) == 1:  # a script that fails in one run of two side by side
                hint = run_collisions.side_by_side_hint(run_collisions.written_since(
                    os.getcwd(), runspec.invocation_started()))
                if hint:
                    raise ScriptFailed(f"{exc}{hint}", details=exc.details) from None
            raise

    def _collect(self, run: Run, deadline: float) -> RunResult:
        """The run has ended or been told to stop: it exits by ``deadline`` (the grace
        period), or is ended by signal (its capture is closed either way); sooner if it
        goes idle without exiting (it waits at exit for a process it started:
        ``end_if_idle``)."""
        while True:
            try:
                return run.wait(timeout=max(min(1.0, deadline - time.monotonic()), 0.01))
            except TimeoutError:
                if run.end_if_idle():
                    return run.wait(timeout=0)
                if time.monotonic() >= deadline:
                    return run.interrupt(forward=True)


def _interrupt_all(runs: list[Run], forward: bool) -> None:
    """End every run at once (each gets its grace in parallel: `docker stop` waits 10 s)."""
    for run in runs:  # all of them before any is signalled
        run.cancel()
    threads = [threading.Thread(target=run.interrupt, kwargs={"forward": forward}, daemon=True)
               for run in runs]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60  # interrupt() itself ends within ~20 s
    for thread in threads:
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                thread.join(0.5)
            except (KeyboardInterrupt, Terminated):
                pass  # a second Ctrl-C: the clean-up goes on (each step of it is bounded)



def check_result(result: RunResult) -> RunResult:
    """The result if the run ended well (complete or stopped), else the error to show."""
    if result.write_error:
        raise CaptureNotWritten(result.write_error + "; the runs were stopped")
    if result.hook_error:
        raise InternalChildError(result.hook_error)
    if result.unsupported:
        raise NondetError(f"run {result.label}: {result.unsupported}; its output is in "
                          f"{result.log_path}")
    if result.status == channel.INTERRUPTED:
        if errors.interrupted_here():
            raise KeyboardInterrupt
        raise ScriptFailed(  # nobody pressed Ctrl-C: the script ended itself that way
            f"the script ended with KeyboardInterrupt in run {result.label} though nondet "
            f"was not interrupted (it raised it, or its process alone got SIGINT); its "
            f"output is in {result.log_path}", details=result.log_tail())
    if result.status in (channel.FAILED, channel.CRASHED):
        shared = run_collisions.collision(f"{result.error}\n{result.log_tail()}")
        if shared is not None:  # the twin run's file, not the script: say so
            raise NondetError(f"run {result.label} failed because {shared}; its output is in "
                              f"{result.log_path}", details=result.log_tail())
        last = clip(exception_line(result.error) or _exception_line(result.log_tail()),
                    LINE_MAX)
        how = f"exit code {result.exit_code}" if result.exit_code >= 0 else \
            f"killed by signal {-result.exit_code}"
        raise ScriptFailed(
            f"the script failed in run {result.label} ({how})"
            + (f": {last}" if last else "")
            + importpath.shadowed_hint(f"{result.error}\n{result.log_tail()}")
            + _stdin_hint(f"{result.error}\n{result.log_tail()}")
            + f"; its output is in {result.log_path}",
            details=result.log_tail(),
        )
    return result


#: The script's failure when it reads a line of input: each run's stdin is empty.
_READ_INPUT = re.compile(r"^EOFError: EOF when reading a line", re.MULTILINE)


def _stdin_hint(failure: str) -> str:
    """Why a run found no input: nondet gives both runs an empty stdin (one input cannot be
    read twice, and a prompt would wait for good); "" for other failures."""
    if not _READ_INPUT.search(failure):
        return ""
    return ("; nondet runs the script with an empty stdin (both runs must see the same input, "
            "and neither may wait for a prompt): pass the input as an argument, a file or an "
            "environment variable")


class InternalChildError(Exception):
    """nondet's own hooks failed inside the recorded run (a nondet bug: exit 3)."""

    def __init__(self, child_traceback: str) -> None:
        super().__init__("nondet's hooks failed inside the recorded run: "
                         + (child_traceback.strip().splitlines() or ["?"])[-1])
        self.child_traceback = child_traceback


def _exception_line(log_tail: str) -> str:
    """The exception line of a traceback the script's output ends with; "" when it printed
    none (``os._exit(7)`` mid-training): its last line is then whatever it printed last
    (TensorFlow's start-up log), not the error, and is shown with the rest of the output."""
    if "Traceback (most recent call last)" not in log_tail \
            and "Fatal Python error" not in log_tail:
        return ""
    return exception_line(log_tail)


#: An exception group's traceback (boxed: "  | " before each line) and its exception line.
_GROUP_HEADER = re.compile(r"^  \+ Exception Group Traceback \(most recent call last\):$",
                           re.MULTILINE)
_GROUP_LINE = re.compile(r"^  \| ((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*Group: .*)$", re.MULTILINE)
_LEAF_LINE = re.compile(r"^ +\| ((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?<!Group)(?::.*)?)$",
                        re.MULTILINE)


def exception_line(text: str) -> str:
    """The line a traceback names its exception on (``ValueError: ...``): the first
    unindented line after its last frame. A message of several lines (Keras's "Exception
    encountered when calling ...", TensorFlow's ``[[{{node ...}}]]`` context) ends with
    lines that say nothing alone (``• kwargs=<class 'inspect._empty'>``). Without a frame
    (a traceback cut short), the last line."""
    group = _GROUP_HEADER.search(text)
    if group is not None:  # an exception group's: the group's own line, not its last box
        named = _GROUP_LINE.search(text, group.end())
        if named is not None:
            leaf = _LEAF_LINE.search(text, named.end())  # the first that is no group
            first = f" (the first: {leaf.group(1).strip()})" if leaf is not None else ""
            return named.group(1).strip() + first
    lines = text.strip().split("\n")
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if frames:
        for line in lines[frames[-1] + 1:]:
            if line.strip() and not line.startswith(" "):
                return line.strip()
    return last_line(text)


def last_line(text: str) -> str:
    """The last non-empty line of a traceback (its exception). Split at newlines only: a
    carriage return or form feed inside the exception's message is no line of its own
    (``splitlines`` cut "RuntimeError: boom\\rEVIL" to "EVIL")."""
    lines = [line.strip() for line in text.strip().split("\n") if line.strip()]
    return lines[-1] if lines else ""
