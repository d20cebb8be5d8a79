"""A real recorded run (``CapturedRun`` with its child process) against scripts that do odd
things with their process: start a process that outlives them, close nondet's pipe. No
framework is imported, so each takes a second or two plus what the script waits."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

from nondet.launch import CapturedRun, Plan, Target


def _run_script(tmp_path: Path, text: str) -> tuple[CapturedRun, float]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(text))
    run = CapturedRun(Target(str(script), None), Plan("a", []), 0, tmp_path)
    started = time.monotonic()
    run.start()
    run.wait(timeout=120)
    return run, time.monotonic() - started


def test_a_process_that_outlives_the_script_holding_its_output_does_not_hold_the_run(
        tmp_path: Path) -> None:
    # A server or logger daemon the script starts keeps the run's stdout open: the output
    # never reaches end-of-file. Before, the run's end waited 30 s for it (per run).
    run, seconds = _run_script(tmp_path, """
        import subprocess, sys
        daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("daemon", daemon.pid, flush=True)
        print("trained")
    """)
    log = run.log_path.read_text()
    try:
        assert "trained" in log, log
        assert seconds < 15, seconds  # it ends within launch.OUTPUT_QUIET of the script
    finally:
        os.kill(int(log.split()[1]), signal.SIGKILL)


def test_a_script_that_replaces_nondets_pipe_is_still_recorded(tmp_path: Path) -> None:
    # dup2 over every low descriptor (a redirect gone wide): the run went on unrecorded
    # (then named in one line); the pipe is now opened again (fdguard.live), and nothing
    # goes into the script's file. tests/test_faults_env.py has the run that cannot reopen.
    run, _ = _run_script(tmp_path, f"""
        import os, time
        log = os.open({str(tmp_path / "own.log")!r}, os.O_WRONLY | os.O_CREAT)
        for fd in range(3, 256):
            if fd != log:
                try:
                    os.dup2(log, fd)
                except OSError:
                    pass
        time.sleep(2)  # the parent sees the pipe lose its writer while the run goes on
    """)
    result = run.wait()
    assert result.unsupported == "" and run.end is not None, result
    assert (tmp_path / "own.log").read_bytes() == b""  # no frame went into the script's file


def test_a_run_cancelled_with_nondet_ends_interrupted_though_its_twin_had_it_stopped(
        tmp_path: Path) -> None:
    # SIGTERM to nondet: each run is interrupted from its own thread. Run a ended first and
    # turn-taking, seeing a step only one run had, told b to stop; b, its signal still on
    # the way (a loaded machine), stopped at a step boundary and its capture said "stopped"
    # (ended on purpose, complete) for a cancelled job (a flaky test_faults case in CI).
    # Here b's thread is late on purpose and a's interrupt asks b to stop, as turns did.
    from nondet.schedule import _interrupt_all
    from nondet.store import open_capture

    steps = str(Path(__file__).parent / "data" / "scripts" / "steps.py")
    target = Target(steps, None, ("--steps", "400", "--sleep", "0.05"))
    a, b = (CapturedRun(target, Plan(label, []), 0, tmp_path) for label in "ab")
    for run in (a, b):
        run.start()
    deadline = time.monotonic() + 120
    while "step 1 done" not in b.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    interrupt_a, interrupt_b = a.interrupt, b.interrupt

    def a_then_turns_stop_b(forward: bool = False) -> object:
        result = interrupt_a(forward=forward)
        b.request_stop()
        return result

    def late_b(forward: bool = False) -> object:
        time.sleep(3)  # a ends and b would read the stop word at its next step (0.05 s)
        return interrupt_b(forward=forward)

    a.interrupt, b.interrupt = a_then_turns_stop_b, late_b  # type: ignore[method-assign]
    _interrupt_all([a, b], forward=True)
    for run in (a, b):
        assert open_capture(run.path).status == "interrupted", run.plan.label
