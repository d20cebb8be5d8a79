"""Rows stored in batches (Note [Rows stored in batches] in nondet/store/writer.py): the
writer keeps a run's rows in memory and stores them together, never losing what a run sent
when nondet ends normally, and no more than ``store_every`` seconds of it when nondet is
SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from nondet.records import OP_DTYPE
from nondet.store import CaptureWriter, open_capture
from tests.conftest import run_cli, step_rows

REPO = Path(__file__).resolve().parent.parent
STEPS = str(REPO / "tests" / "data" / "scripts" / "steps.py")

# Steps 0 and 1 wait; store_due after the interval stores them; step 2 waits when nondet is
# killed (store_every: 0.2 s), so the file keeps exactly steps 0 and 1.
_KILLED_BETWEEN_STORES = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from nondet.store.writer import CaptureWriter
from tests.conftest import step_rows
writer = CaptureWriter(Path(sys.argv[1]), {{"label": "a", "seed": 0}}, store_every=0.2)
writer.add_step(step_rows({{"step": 0, "params_fp": 1}}))
writer.add_step(step_rows({{"step": 1, "params_fp": 2}}))
time.sleep(0.3)
writer.store_due()
writer.add_step(step_rows({{"step": 2, "params_fp": 3}}))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writer_keeps_every_row_stored_before_its_last_batch(tmp_path: Path) -> None:
    path = tmp_path / "run-a.h5"
    done = subprocess.run([sys.executable, "-c", _KILLED_BETWEEN_STORES.format(repo=str(REPO)),
                           str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    capture = open_capture(path)
    assert capture.status == "interrupted"  # never closed
    assert [int(r["step"]) for r in capture.steps] == [0, 1]
    assert capture.n_steps == 2
    assert int(capture.attrs["steps"]) == 2  # the count attribute agrees with the table


# A row that fills the byte cap is stored at once, with a step count that includes it.
_STORED_BY_THE_CAP = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from nondet.store.writer import CaptureWriter
from tests.conftest import step_rows
CaptureWriter.MAX_PENDING_BYTES = 1
writer = CaptureWriter(Path(sys.argv[1]), {{"label": "a", "seed": 0}}, store_every=3600)
writer.add_step(step_rows({{"step": 0, "params_fp": 1}}))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_row_stored_by_the_byte_cap_is_counted_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run-a.h5"
    done = subprocess.run([sys.executable, "-c", _STORED_BY_THE_CAP.format(repo=str(REPO)),
                           str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    capture = open_capture(path)
    assert [int(r["step"]) for r in capture.steps] == [0]
    assert int(capture.attrs["steps"]) == 1


def test_closing_stores_the_rows_that_wait_with_their_op_index(tmp_path: Path) -> None:
    """Several steps' ops wait together: each step's index must still point at its own."""
    path = tmp_path / "run-a.h5"
    writer = CaptureWriter(path, {"label": "a", "seed": 0}, store_every=3600)
    for step, count in ((0, 3), (1, 5), (2, 2)):
        ops = np.zeros(count, dtype=OP_DTYPE)
        ops["step"] = step
        ops["name"] = 0
        ops["out_fp"] = np.arange(count) + 100 * step
        writer.add_strings(["op"])
        writer.add_ops(ops)
        writer.add_step(step_rows({"step": step, "params_fp": step + 1}))
    writer.close("complete", 0)
    capture = open_capture(path)
    assert capture.n_steps == 3 and capture.status == "complete"
    for step, count in ((0, 3), (1, 5), (2, 2)):
        ops = capture.ops(step)
        assert list(ops["out_fp"]) == [100 * step + i for i in range(count)]


# steps.py trains step 0, then sleeps 4 s: nondet is SIGKILLed 2 s in. Step 0's row came
# moments after the step before it was stored, so it waited; only the reading loop's
# store_due between reads puts it in the file.
_KILLED_WHILE_THE_RUN_IS_QUIET = """
import os, signal, sys, time, tempfile
from pathlib import Path
sys.path.insert(0, {repo!r})
from nondet.launch import CapturedRun, Plan, Target
out = Path(sys.argv[1])
run = CapturedRun(Target({steps!r}, None, ("--steps", "2", "--sleep", "4")), Plan("a", []),
                  0, out)
run.start()
deadline = time.monotonic() + 60
while 0 not in [int(r["step"]) for r in list(run.steps)]:
    assert time.monotonic() < deadline, "step 0 never ended"
    time.sleep(0.05)
time.sleep(2.0)
os.killpg(os.getpid(), signal.SIGKILL)  # nondet and its run, as a CI timeout would
"""


def test_the_rows_of_a_quiet_run_reach_the_file_before_its_next_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = _KILLED_WHILE_THE_RUN_IS_QUIET.format(repo=str(REPO), steps=STEPS)
    proc = subprocess.Popen([sys.executable, "-c", script, str(out)], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, stderr
    time.sleep(0.2)  # the killed group's file lock is released
    capture = open_capture(out / "run-a.h5")
    assert capture.status == "interrupted"
    assert 0 in [int(r["step"]) for r in capture.steps]


_READER_FAILS = """
from nondet import stream
_handle = stream.RunStream._handle_frames
def failing(self, frames):
    if any(kind == b"P" for kind, _ in frames) and len(self.steps) >= 2:
        raise RuntimeError("injected reader failure")
    _handle(self, frames)
stream.RunStream._handle_frames = failing
"""


def test_nondets_own_reader_failing_is_an_internal_error_not_a_verdict(tmp_path: Path) -> None:
    """A bug in the parent's frame reader once killed its thread silently: the runs lost
    their pipe, stopped early as "complete", and nondet called the truncated captures
    deterministic (exit 0)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_READER_FAILS)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    result = run_cli("run", "-q", STEPS, "--steps", "40", cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr)
    assert "injected reader failure" in result.stderr
    assert "deterministic" not in result.stdout
