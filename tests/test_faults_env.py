"""Hostile environments no other test covers: nondet's pipe closed from C, output written
by a process the script left running after it ended. Each case is a real run
(``CapturedRun`` and its child process; no framework imported unless the test says so)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli, step_rows, write_capture
from tests.test_run_process import _run_script

# A library that closes every inherited descriptor from C (before an exec, say): fdguard's
# os.close/os.closerange wrappers never see it.
_CLOSE_FROM_C = """
import ctypes
libc = ctypes.CDLL(None)
for fd in range(3, 256):
    libc.close(fd)
"""


def test_a_pipe_closed_from_c_is_opened_again_and_the_run_ends_recorded(
        tmp_path: Path) -> None:
    # Before: the END never arrived (the run ended "complete" with nothing said); a short
    # run was then "no training step was observed", a long one lost after 5 s.
    run, _ = _run_script(tmp_path, _CLOSE_FROM_C + """
import time
print("closed", flush=True)
time.sleep(1.5)  # the parent sees the pipe lose its writer while the run goes on
""")
    result = run.wait()
    assert run.end is not None and run.end.status == "complete", run.log_path.read_text()
    assert result.unsupported == ""
    assert result.status == "complete"


def test_a_pipe_closed_from_c_that_cannot_be_opened_again_is_named_in_one_line(
        tmp_path: Path) -> None:
    # As where /proc cannot be opened (hidepid, another user): the run ends soon after
    # (before: within launch's 5 s grace it passed for a run that never trained)
    run, _ = _run_script(tmp_path, """
from nondet import fdguard
getattr(fdguard, "_REOPEN", {}).clear()  # no way back to the pipe
""" + _CLOSE_FROM_C + """
import time
time.sleep(1.0)
""")
    result = run.wait()
    assert "the script closed file descriptor" in result.unsupported, result
    assert "from C" in result.unsupported


@pytest.mark.e2e
def test_a_training_script_that_closes_the_pipe_from_c_is_compared_over_every_step(
        tmp_path: Path) -> None:
    # The trial: every step after the close was lost, then "no training step was observed"
    # or the run's first steps only
    script = tmp_path / "train.py"
    script.write_text(
        "import ctypes, torch\n"
        "libc = ctypes.CDLL(None)\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(8, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(4):\n"
        "    if step == 1:\n"
        "        for fd in range(3, 256):\n"
        "            libc.close(fd)\n"
        "    loss = model(torch.ones(4, 8)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n")
    result = run_cli("run", "-q", "--json", "r.json", str(script), cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [r["steps"] for r in runs] == [4, 4], runs


# The script starts a process that outlives it holding the run's output, and writes its
# pid to DIR/daemon.pid (the test ends it). {body} is that process's code.
_LEFT_RUNNING = """
import subprocess, sys
daemon = subprocess.Popen([sys.executable, "-c", {body!r}])
open({pid!r}, "w").write(str(daemon.pid))
print("script done", flush=True)
"""

_PRINTS_LATE = """
import sys, time
time.sleep(1.6)  # the run is over and its pipe has been quiet: nondet stopped reading
for i in range(8):
    sys.stdout.write("block %d " % i + "x" * 32768 + "\\n")
    sys.stdout.flush()
open({marker!r}, "w").close()
time.sleep(60)
"""


def test_a_process_left_printing_after_the_run_never_blocks_and_its_output_is_kept(
        tmp_path: Path) -> None:
    # Before: once the pipe was quiet after the run's end nobody read it, so the process
    # blocked for good after 64 KiB (and its output was lost) while nondet went on
    marker = tmp_path / "daemon-finished"
    body = _PRINTS_LATE.format(marker=str(marker))
    run, _ = _run_script(tmp_path, _LEFT_RUNNING.format(body=body,
                                                        pid=str(tmp_path / "daemon.pid")))
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the process the script left running blocked on its output"
        time.sleep(0.5)
        log = run.log_path.read_text()
        assert "script done" in log and "block 7 " in log, log[-300:]
    finally:
        _kill_daemon(tmp_path)


_PRINTS_FOR_GOOD = """
import time
for i in range(600):
    print("tick", i, flush=True)
    time.sleep(0.1)
"""


def test_a_process_left_printing_for_good_does_not_hold_the_runs_end(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Before: never quiet, so the output thread read on and the run's end waited 30 s for
    # it, then closed the log under it (a thread traceback on nondet's stderr)
    run, seconds = _run_script(tmp_path, _LEFT_RUNNING.format(
        body=_PRINTS_FOR_GOOD, pid=str(tmp_path / "daemon.pid")))
    try:
        assert seconds < 20, seconds
        time.sleep(1.0)
        assert "Traceback" not in capfd.readouterr().err
        assert "script done" in run.log_path.read_text()
    finally:
        _kill_daemon(tmp_path)


def _kill_daemon(tmp_path: Path) -> None:
    try:
        os.kill(int((tmp_path / "daemon.pid").read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def test_a_script_that_execs_another_program_says_what_was_not_recorded(
        tmp_path: Path) -> None:
    # Trial: os.execv(sys.executable, [..., "stage2"]) trained on in the exec'd program
    # and the report said "deterministic" over the first stage alone, with nothing said
    from nondet.store import open_capture

    run, _ = _run_script(tmp_path, """
import os, sys
if sys.argv[1:] != ["stage2"]:
    os.execv(sys.executable, [sys.executable, __file__, "stage2"])  # line 4
print("stage2 ran", flush=True)
""")
    assert "stage2 ran" in run.log_path.read_text()
    facts = open_capture(run.path).facts
    assert "os.execv at " in str(facts.get("capture_note.exec")), facts
    assert facts["script.ended_at"]["source"].endswith("train.py:4"), facts


def test_a_bare_fork_in_the_script_is_noted_at_its_line(tmp_path: Path) -> None:
    # Trial: the child of a bare os.fork() trained (unrecorded: hooks are off after a fork)
    # while the parent waited: "no training step was observed", nothing said of the fork;
    # with the parent training after it, "deterministic" with nothing said. A fork made by
    # a library (multiprocessing here, whose children are recorded) is not the user's line.
    from nondet.store import open_capture

    run, _ = _run_script(tmp_path, """
import multiprocessing, os
pid = os.fork()  # line 3
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
proc = multiprocessing.get_context("fork").Process(target=print, args=("in a child",))
proc.start(); proc.join()
print("parent done", flush=True)
""")
    assert "parent done" in run.log_path.read_text()
    facts = open_capture(run.path).facts
    notes = [v for k, v in facts.items() if k.startswith("capture_note.fork")]
    assert len(notes) == 1, facts
    assert "train.py:3 (os.fork): the child process is not recorded" in notes[0], notes


def test_nondet_out_of_descriptors_is_the_limit_named_in_one_line(tmp_path: Path) -> None:
    # Trial: `ulimit -n 20` (16 here, for a script that imports nothing; it runs alone) was
    # "internal error: OSError: [Errno 24] Too many open files", exit 3, a bug log
    import resource
    import subprocess
    import sys

    (tmp_path / "train.py").write_text("print('hello')\n")

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))

    done = subprocess.run([sys.executable, "-m", "nondet", "run", "-q", "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          preexec_fn=few_files, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "`ulimit -n` is 16" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


_STEPS: list[dict[str, Any]] = [
    {"step": -1, "params_fp": 1},
    {"step": 0, "loss": 0.5, "loss_fp": 7, "grads_fp": 2, "params_fp": 3}]


@pytest.mark.parametrize("both", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_a_reader_that_goes_away_does_not_turn_the_verdict_into_nondeterministic(
        tmp_path: Path, both: bool) -> None:
    # Trial: `nondet check train.py | true` (or `| head -1`) on a deterministic script
    # exited 1, "nondeterminism found": click makes a broken pipe exit 1, silently; with
    # `2>&1 | true` nondet died at its first progress line, before any run
    import subprocess
    import sys

    # captures of two script versions: diff warns on stderr, then says "deterministic"
    a = write_capture(tmp_path / "a.h5", step_rows(*_STEPS), attrs={"script_sha256": "1"})
    b = write_capture(tmp_path / "b.h5", step_rows(*_STEPS), attrs={"script_sha256": "2"})
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before nondet writes its verdict
    done = subprocess.run([sys.executable, "-m", "nondet", "diff", str(a), str(b)],
                          stdout=write_end, stderr=write_end if both else subprocess.PIPE,
                          text=True, timeout=120,
                          env={**os.environ, "NO_COLOR": "1"})
    os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in (done.stderr or "") and "Exception" not in (done.stderr or "")


def test_a_capture_compared_with_itself_is_refused_not_called_deterministic(
        tmp_path: Path) -> None:
    # Trial: `nondet diff a.h5 a.h5` (a typo for run-b.h5) said "deterministic", exit 0
    a = write_capture(tmp_path / "a.h5", step_rows(*_STEPS))
    (tmp_path / "link.h5").symlink_to(a)
    result = run_cli("diff", str(a), "link.h5", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "are the same file" in lines[0], result.stderr


@pytest.mark.parametrize("module", ["numpy.py", "h5py/__init__.py"])
@pytest.mark.parametrize("body", ["raise ImportError('broken on purpose')\n", ""])
def test_a_dependency_shadowed_on_pythonpath_is_named_in_one_line(
        tmp_path: Path, module: str, body: str) -> None:
    # Trial: PYTHONPATH with a broken numpy.py or h5py/ before the installed one was
    # "internal error" (exit 3, a bug log): the machine's trouble, not nondet's
    shadow = tmp_path / "shadow" / module
    shadow.parent.mkdir(parents=True)
    shadow.write_text(body)
    pythonpath = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(tmp_path / "shadow")])
    (tmp_path / "train.py").write_text("print(1)\n")
    result = run_cli("run", "-q", "train.py", cwd=tmp_path, env={"PYTHONPATH": pythonpath},
                     timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    package = module.split(".")[0].split("/")[0]
    assert len(lines) == 1 and f"importing {package} from {shadow}" in lines[0], lines
    assert f"PYTHONPATH entry {tmp_path / 'shadow'}" in lines[0]


def test_a_run_that_dies_after_closing_the_pipe_is_told_as_dying(tmp_path: Path) -> None:
    # Control (passed before too): its death says more than the closed pipe
    run, _ = _run_script(tmp_path, """
from nondet import fdguard
getattr(fdguard, "_REOPEN", {}).clear()
""" + _CLOSE_FROM_C + """
import os, signal, time
time.sleep(1.0)
os.kill(os.getpid(), signal.SIGKILL)
""")
    result = run.wait()
    assert result.unsupported == "" and result.status == "crashed", result
    assert result.exit_code == -signal.SIGKILL
