"""Faults through the real CLI: whatever state the two runs end in, nondet ends, within a
bound, with the documented exit code and one line; captures stay readable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nondet.store import open_capture
from tests.conftest import REPO, run_cli

STEPS = str(REPO / "tests" / "data" / "scripts" / "steps.py")
BOUND = 240  # seconds; each case takes ~30 s on a loaded 2-core machine
SCHEDULES = [[], ["--schedule", "sequential"]]
SCHEDULE_IDS = ["lockstep", "sequential"]

# Both runs share the working directory. The first run to reach step 1 makes a directory
# (or a marker), so the second run to get there fails (or stops early): in lockstep run a
# goes first at every step, sequentially it runs first. So it is always run b.
_TRAIN = """
import os, sys, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    {at_step_1}
    loss = model(torch.ones(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""
FAILS_IN_SECOND = _TRAIN.format(at_step_1="""if step == 1:
        os.makedirs("outputs")  # no exist_ok: the second run fails""")
ENDS_EARLY_IN_SECOND = _TRAIN.format(at_step_1="""if step == 2:
        try:
            os.close(os.open("done-early", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            break  # "early stopping" in the run that comes second""")


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("nondet: error")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr.split("  |")[0], stderr
    return errors[0]


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_a_script_that_fails_in_one_run_only_exits_2_naming_the_run(
        tmp_path: Path, schedule: list[str]) -> None:
    script = _script(tmp_path, FAILS_IN_SECOND)
    result = run_cli("run", "-q", *schedule, script, cwd=tmp_path, timeout=BOUND)
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result.stderr)
    assert "the script failed in run b (exit code 1): FileExistsError" in line
    for label in "ab":
        capture = open_capture(_captured(tmp_path / ".nondet", f"run-{label}.h5"))
        assert capture.status != "running"  # closed
    assert open_capture(_captured(tmp_path / ".nondet", "run-b.h5")).status == "failed"


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_a_run_that_ends_early_is_not_an_error_and_both_captures_close(
        tmp_path: Path, schedule: list[str]) -> None:
    script = _script(tmp_path, ENDS_EARLY_IN_SECOND)
    result = run_cli("run", "-q", "--json", "r.json", *schedule, script, cwd=tmp_path,
                     timeout=BOUND)
    assert result.returncode in (0, 1), result.stderr  # a finding (or none), not an error
    assert "nondet: error" not in result.stderr and "Traceback" not in result.stderr
    runs = {r["label"]: r for r in json.loads((tmp_path / "r.json").read_text())["runs"]}
    assert runs["b"]["steps"] == 2 and runs["b"]["status"] == "complete"
    assert runs["a"]["steps"] > 2 and runs["a"]["complete"]
    for label in "ab":
        assert open_capture(_captured(tmp_path / ".nondet", f"run-{label}.h5")).status in (
            "complete", "stopped")


_THREADS = """
import threading, torch
torch.manual_seed(0)
models = [torch.nn.Linear(32, 1) for _ in range(2)]
both = threading.Barrier(2)
stepped = [threading.Event(), threading.Event()]
def train(i):
    opt = torch.optim.SGD(models[i].parameters(), lr=0.1)
    for step in range(10):
        loss = models[i](torch.ones(64, 32) * (i + 1)).pow(2).mean()
        {meet}
        opt.zero_grad(); loss.backward()
        try:
            opt.step()
        finally:
            stepped[i].set()
        {wait}
threads = [threading.Thread(target=train, args=(i,)) for i in {order}]
{run}
"""
# Both threads are in their first step at once, and neither goes on before the other's first
# update is over (on a loaded machine the first could otherwise finish its ten tiny steps
# before the second ends one: one after the other, not at once).
TWO_AT_ONCE = _THREADS.format(order="(0, 1)", meet="step or both.wait(timeout=60)",
                              wait="stepped[1 - i].wait(timeout=60)",
                              run="[t.start() for t in threads]; [t.join() for t in threads]")
ONE_AFTER_THE_OTHER = _THREADS.format(order="(0, 1)", meet="", wait="",
                                      run="for t in threads:\n    t.start(); t.join()")


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_training_in_two_threads_at_once_is_refused_in_one_line(
        tmp_path: Path, schedule: list[str]) -> None:
    # Each thread trains its own model (the script repeats), but their steps interleave by
    # thread timing: lockstep hung (two threads waiting for turns on one pipe), and the
    # step rows differed (a false alarm). nondet cannot record it: exit 2, never a verdict.
    script = _script(tmp_path, TWO_AT_ONCE)
    result = run_cli("run", "-q", *schedule, script, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "trains in two threads at once" in _one_error_line(result.stderr)
    logs = sorted((tmp_path / ".nondet").glob("*/run-*.log"))  # sequentially: run a only
    assert logs
    for log in logs:  # nondet's stop of a thread is not the user's output
        assert "StopRun" not in log.read_text()


def test_training_threads_one_after_the_other_are_compared(tmp_path: Path) -> None:
    script = _script(tmp_path, ONE_AFTER_THE_OTHER)
    result = run_cli("run", "-q", "--json", "r.json", script, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [r["steps"] for r in runs] == [20, 20]


_SETS_UP_WHILE_THE_OTHER_TRAINS = """
import os, threading, torch
torch.manual_seed(0)
models = [torch.nn.Linear(32, 1) for _ in range(2)]

def first_here():
    try:
        os.close(os.open("came-first", os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False

# The step of the first thread at which the second sets up: thread timing, made repeatable.
at = 1 if first_here() else 3
reached, ready = threading.Event(), threading.Event()

def train(i, opt):
    for step in range(5):
        loss = models[i](torch.ones(64, 32) * (i + 1)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if i == 0 and step == at:
            reached.set(); ready.wait(60)

def first():
    train(0, torch.optim.SGD(models[0].parameters(), lr=0.1))

def second():
    reached.wait(60)
    opt = torch.optim.SGD(models[1].parameters(), lr=0.1)  # made while the first trains
    with torch.no_grad():
        models[1](torch.ones(1, 32))
    ready.set()
    threads[0].join()  # trains only once the first is done
    train(1, opt)

threads = [threading.Thread(target=first), threading.Thread(target=second)]
[t.start() for t in threads]; [t.join() for t in threads]
"""


def test_a_model_made_on_another_thread_joins_the_steps_at_the_same_point(
        tmp_path: Path) -> None:
    # The second thread makes its optimizer (and calls its model) during the first thread's
    # steps, at step 1 in one run and step 3 in the other (thread timing, made repeatable),
    # and trains only after the first has ended: the same script. Its parameters joined the
    # first thread's step state where they were made: "params differ" at step 2, exit 1.
    script = _script(tmp_path, _SETS_UP_WHILE_THE_OTHER_TRAINS)
    result = run_cli("run", "-q", "--json", "r.json", script, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [r["steps"] for r in runs] == [10, 10]


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    return [int(p) for p in out.split()]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_sigterm_stops_the_runs_and_exits_143(tmp_path: Path, signum: int) -> None:
    # SIGUSR1: Slurm's warning before a time limit (``--signal=USR1@60``); its default
    # action ended nondet at once, exit 138 without a word (faults round 13)
    proc = subprocess.Popen([sys.executable, "-m", "nondet", "run", "-q", STEPS, "--steps",
                             "400", "--sleep", "0.05"], cwd=tmp_path,
                            env={**os.environ, "NO_COLOR": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _terminate_and_check(proc, tmp_path, signum)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a failed test leaves nothing behind
        except ProcessLookupError:
            pass
        proc.communicate()


def _terminate_and_check(proc: subprocess.Popen[str], tmp_path: Path,
                         signum: int = signal.SIGTERM) -> None:
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        time.sleep(0.2)
        logs = sorted((tmp_path / ".nondet").glob("*/run-a.log"))  # made once the run starts
        if logs and "step 1 done" in logs[0].read_text():
            break
    children = _children_of(proc.pid)
    assert proc.poll() is None and children, "the run ended before it could be terminated"
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"terminated ({signal.Signals(signum).name})" in lines[0], stderr
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]
    for label in "ab":
        capture = open_capture(_captured(tmp_path / ".nondet", f"run-{label}.h5"))
        assert capture.status == "interrupted" and capture.n_steps >= 1


_FULL_DISK = """
import errno, os
if os.environ.get("NONDET_TEST_ENOSPC_AT") and "NONDET_CHILD_CONFIG" not in os.environ:
    # nondet itself (not its runs): the capture writer fails as on a full disk
    from nondet import store

    _add_step = store.CaptureWriter.add_step
    _at = int(os.environ["NONDET_TEST_ENOSPC_AT"])

    def add_step(self, rows):
        # rows come in batches (one HDF5 append per read): those before the limit fit
        fits = rows[rows["step"] < _at]
        if len(fits):
            _add_step(self, fits)
        if len(fits) < len(rows):
            raise OSError(errno.ENOSPC, "No space left on device")

    store.CaptureWriter.add_step = add_step
"""


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_disk_full_exits_2_with_one_line_and_readable_captures(
        tmp_path: Path, schedule: list[str]) -> None:
    """A full disk, simulated in nondet's own process (sitecustomize), not in the runs."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FULL_DISK)
    env = {"NONDET_TEST_ENOSPC_AT": "2",
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    result = run_cli("run", "-q", *schedule, STEPS, "--steps", "6", cwd=tmp_path, env=env,
                     timeout=BOUND)
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result.stderr)
    assert "no space left on " in line and "while writing" in line and "run-a.h5" in line
    assert "Traceback" not in result.stderr
    capture = open_capture(_captured(tmp_path / ".nondet", "run-a.h5"))
    assert capture.status == "write_failed" and capture.n_steps == 2  # steps 0 and 1


def _run_bounded(command: list[str], cwd: Path,
                 preexec: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    """Run in its own process group; on timeout kill the whole group (nondet and its runs)
    and fail, so a regression neither hangs the suite nor leaves processes behind."""
    proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, "NO_COLOR": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=preexec)
    try:
        stdout, stderr = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"still running after {BOUND} s")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                           capture_output=True, check=False, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unprivileged user+mount namespaces")
def test_a_real_full_filesystem_stops_in_time_to_close_the_captures(tmp_path: Path) -> None:
    """--out on a small tmpfs (in a private mount namespace): nondet stops writing while the
    files can still be closed, so no h5py crash and both captures open."""
    out = tmp_path / "small"
    out.mkdir()
    check = ("import glob\nfrom nondet.store import open_capture\n"
             f"for label in 'ab':\n"
             f"    c = open_capture(glob.glob('{out}/*/run-' + label + '.h5')[0])\n"
             "    print('capture', label, c.status, c.n_steps)\n")
    (tmp_path / "check.py").write_text(check)
    script = (f"mount -t tmpfs -o size=1200k tmpfs {out} || exit 99\n"
              f"{sys.executable} -m nondet run -q --ops all --out {out} {STEPS} --steps 20000\n"
              f"echo rc=$?\n"
              f"{sys.executable} {tmp_path / 'check.py'}\n")
    result = _run_bounded(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path)
    assert "rc=2" in result.stdout, result.stdout + result.stderr
    line = _one_error_line(result.stderr)
    assert f"no space left on {out} while writing {out}/" in line and "/run-" in line
    assert "Traceback" not in result.stderr and "Segmentation" not in result.stderr
    captures = [line.split() for line in result.stdout.splitlines()
                if line.startswith("capture ")]
    # the run whose write was refused says so; the other was stopped then (or was refused
    # too, when both reached the reserve before the stop)
    statuses = sorted(c[2] for c in captures)
    assert statuses in (["stopped", "write_failed"], ["write_failed", "write_failed"]), \
        result.stdout
    assert all(int(c[3]) > 100 for c in captures)  # everything up to the last flushed step


def _captured(out: Path, name: str) -> Path:
    """A file of the (one) invocation directory nondet made under ``out``."""
    found = sorted(out.glob(f"*/{name}"))
    assert found, sorted(out.rglob("*"))
    return found[0]


def test_an_hdf5_write_failure_is_named_by_its_cause(tmp_path: Path) -> None:
    # h5py reports a refused write (RLIMIT_FSIZE: EFBIG) at flush as a RuntimeError with
    # HDF5's whole error text; the run stopped with a pump-thread traceback instead of one line
    from nondet.stream import hdf5_write_failed, write_failure

    text = ("Unable to synchronously flush file (file write failed: time = Tue Nov 24 "
            "04:10:24 2026\n, filename = 'run-a.h5', file descriptor = 3, errno = 27, "
            "error message = 'File too large', buf = 0x7fa900055e82, total write size = 4158)")
    assert hdf5_write_failed(RuntimeError(text))
    assert not hdf5_write_failed(RuntimeError("Unable to open object"))
    assert write_failure(tmp_path / "run-a.h5", OSError(text)) == (
        f"cannot write {tmp_path / 'run-a.h5'}: File too large")


_FILL_UNDER_FSIZE = """
import resource, sys
import numpy as np
from nondet.records import STEP_DTYPE
from nondet.store import CaptureWriter
resource.setrlimit(resource.RLIMIT_FSIZE, (48 * 1024, 48 * 1024))
writer = CaptureWriter(__import__("pathlib").Path(sys.argv[1]), {"command": "x"})
row = np.zeros(1, dtype=STEP_DTYPE)
try:
    for step in range(100000):
        row["step"] = step
        writer.add_step(row)
        writer.add_ops(np.zeros(64, dtype=__import__("nondet.records").records.OP_DTYPE))
except (OSError, RuntimeError) as exc:
    print("refused", type(exc).__name__, flush=True)
try:
    writer.close("write_failed", None)
except (OSError, RuntimeError):
    pass
print("closed", flush=True)
"""


def test_a_capture_refused_by_the_file_size_limit_closes_without_crashing(
        tmp_path: Path) -> None:
    # RLIMIT_FSIZE (`ulimit -f`): HDF5 retried the refused writes at close and at interpreter
    # exit, where the process segfaulted (exit 139) after nondet had said "cannot write"
    script = tmp_path / "fill.py"
    script.write_text(_FILL_UNDER_FSIZE)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run-a.h5")],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "refused" in result.stdout and "closed" in result.stdout
    assert "Exception ignored" not in result.stderr, result.stderr[-2000:]


@pytest.mark.e2e
@pytest.mark.parametrize("limit_kib", [8, 64])
def test_the_file_size_limit_exits_2_with_one_line(tmp_path: Path, limit_kib: int) -> None:
    """`ulimit -f` below a capture's size: refused at the first flush (8 KiB: was "internal
    error", exit 3) or mid-run (64 KiB: was a segfault, exit 139)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_kib * 1024, limit_kib * 1024))

    command = [sys.executable, "-m", "nondet", "run", "-q", "--ops", "all", STEPS,
               "--steps", "3000"]
    done = _run_bounded(command, tmp_path, preexec=limit)
    stderr = done.stderr
    assert done.returncode == 2, (done.returncode, stderr[-3000:])
    line = _one_error_line(stderr)
    assert "cannot write " in line and "File too large" in line, line
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]


_EXITS_IN_SECOND = """
import os, sys, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def stop_if_second(how):
    try:
        os.close(os.open("done-early", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        if how == "os":
            os._exit(0)  # line 12
        sys.exit(0)  # line 13

for step in range(5):
    if step == 2:
        stop_if_second(sys.argv[1])
    loss = model(torch.ones(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.e2e
@pytest.mark.parametrize(("how", "line"), [("sys", 13), ("os", 12)])
def test_a_run_that_exits_early_names_the_exit_line(tmp_path: Path, how: str, line: int) -> None:
    """sys.exit / os._exit in the run that comes second: the finding names that line (it
    named none before)."""
    script = _script(tmp_path, _EXITS_IN_SECOND)
    result = run_cli("run", "-q", "--json", "r.json", script, how, cwd=tmp_path, timeout=BOUND)
    assert result.returncode == 1, result.stderr
    div = json.loads((tmp_path / "r.json").read_text())["first_divergence"]
    assert div["kind"] == "structure" and div["source"] == f"train.py:{line}", div
    assert f"ended after 2 steps at {how}" in result.stdout, result.stdout
