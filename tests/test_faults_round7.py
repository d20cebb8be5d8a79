"""Faults, seventh round (FINDINGS.md): the user's interpreter settings and locale, names
from the program that are not UTF-8, and more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nondet import analysis, outdir
from nondet.errors import NondetError, ScriptFailed
from nondet.runspec import RunResult
from nondet.store import CaptureWriter, open_capture
from tests.conftest import FIXTURES, run_cli, step_rows, write_capture

_ASCII_LOCALE = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def test_the_verdict_is_printed_under_an_ascii_locale(tmp_path: Path) -> None:
    # Trial: `LC_ALL=C PYTHONUTF8=0 nondet run base.py`: both runs finished, then
    # "internal error: UnicodeEncodeError: 'ascii' codec can't encode character '\u2014'"
    # (the verdict's em dash), exit 3. `diff` prints the same verdict line.
    rows = step_rows({"step": 0, "params_fp": 7}, {"step": 1, "params_fp": 8})
    a = write_capture(tmp_path / "run-a.h5", rows)
    b = write_capture(tmp_path / "run-b.h5", rows)
    result = run_cli("diff", str(a), str(b), cwd=tmp_path, env=_ASCII_LOCALE, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "deterministic" in result.stdout
    assert "internal error" not in result.stderr


def test_a_source_file_name_that_is_not_utf8_is_stored(tmp_path: Path) -> None:
    # Trial: a script importing its helper from a directory named in Latin-1 (b"lib\xe9"):
    # the op records' source "lib\udce9/helper.py:3" (Python's surrogate escape) failed the
    # capture's UTF-8 string table: "internal error: malformed b'S' frame", exit 3.
    writer = CaptureWriter(tmp_path / "run-a.h5", {"label": "a", "seed": 0})
    writer.add_env({"torch_version": "2.13.0"})
    name = b"lib\xe9".decode("utf-8", "surrogateescape")  # what os.fsdecode makes of it
    writer.add_strings(["aten.mm.default", f"{name}/helper.py:3"])
    writer.add_step(step_rows({"step": 0}))
    writer.close("complete", 0)
    capture = open_capture(tmp_path / "run-a.h5")
    assert "lib\\xe9/helper.py:3" in capture.strings


def test_a_non_ascii_script_under_an_ascii_locale_names_the_locale(tmp_path: Path) -> None:
    # Trial: `LC_ALL=C PYTHONUTF8=0 nondet run dé/trå.py`: refused with "the script has a
    # byte that is not UTF-8", which is false (its bytes are UTF-8; this Python decodes
    # them as ASCII), and the user is told to rename a file that is fine.
    (tmp_path / "dé").mkdir()
    (tmp_path / "dé" / "trå.py").write_text("print('hi')\n")
    result = run_cli("run", "--no-verify", "dé/trå.py", cwd=tmp_path, env=_ASCII_LOCALE,
                     timeout=120)
    assert result.returncode == 2, result.stderr
    assert "not UTF-8 (" not in result.stderr
    assert "PYTHONUTF8=1" in result.stderr and "Traceback" not in result.stderr


def test_pruning_keeps_the_newest_invocations_whatever_their_time_zone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Trial: one `nondet run` under TZ=Pacific/Kiritimati (UTC+14), then more in UTC: the
    # first one's directory is named 14 hours ahead and sorted after every later one, so
    # pruning kept it and deleted the newest captures of the UTC invocations instead.
    monkeypatch.setenv("TZ", "<+14>-14")  # UTC+14 (as Pacific/Kiritimati), no tzdata needed
    time.tzset()
    try:
        ahead = outdir.start(tmp_path)
        monkeypatch.setenv("TZ", "UTC")
        time.tzset()
        later = [outdir.start(tmp_path) for _ in range(outdir.KEEP)]
    finally:
        monkeypatch.undo()
        time.tzset()
    # The pid is this process's: mark them ended (another pid, not alive) so they may go.
    for invocation in (ahead, *later):
        marker = invocation.path / outdir.MARKER
        data = json.loads(marker.read_text())
        marker.write_text(json.dumps({**data, "pid": _ended_pid()}))
    outdir.prune(tmp_path, keep=outdir.KEEP)
    assert not ahead.path.exists()
    assert all(invocation.path.exists() for invocation in later)


def _ended_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_captures_of_two_fingerprint_schemes_are_not_compared(tmp_path: Path) -> None:
    # Trial: `nondet diff` of a capture made by a nondet of fingerprint scheme 3 and one of
    # scheme 4 (the TF step fingerprints changed between them): every fingerprint differs,
    # and the verdict was "nondeterministic", exit 1, for runs that were alike.
    rows = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "params_fp": 3})
    old = write_capture(tmp_path / "a.h5", rows,
                        env={"fingerprint_scheme": "3", "nondet_version": "0.25.0"})
    rows["params_fp"] += 100  # the same values, hashed by the other definition
    new = write_capture(tmp_path / "b.h5", rows, env={"fingerprint_scheme": "4"})
    with pytest.raises(NondetError, match="compute fingerprints differently"):
        analysis.compare_captures(open_capture(old), open_capture(new))
    result = run_cli("diff", str(old), str(new), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "fingerprint scheme 3 (nondet 0.25.0)" in result.stderr


_ENDS_ITS_WORKERS = """\
import os, signal, subprocess
import torch
worker = subprocess.Popen(["sleep", "60"])
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the workers are to end
os.killpg(0, signal.SIGTERM)
print("worker ended by signal", -worker.wait())
"""


@pytest.mark.e2e
def test_a_script_signalling_its_own_process_group_ends_its_workers_not_nondet(
        tmp_path: Path) -> None:
    # Trial: cleanup code `os.killpg(0, SIGTERM)` (its own SIGTERM ignored; plain python:
    # the worker ends, exit 0) reached nondet, which shares the runs' process group:
    # "nondet: terminated (SIGTERM)", exit 143 (with SIGKILL: nondet gone without a word).
    (tmp_path / "train.py").write_text(_ENDS_ITS_WORKERS)
    # a session of its own: before the fix the signal reached this test's group too
    result = subprocess.run([sys.executable, "-m", "nondet", "run", "--no-verify", "train.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            start_new_session=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "deterministic" in result.stdout
    logs = [p.read_text() for p in (tmp_path / ".nondet" / "latest").glob("run-*.log")]
    assert len(logs) == 2 and all("worker ended by signal 15" in log for log in logs)


def _steps_elsewhere(tmp_path: Path, how: str) -> tuple[Path, bytes]:
    """A capture whose /steps (or a dump) is stored outside it, and the bytes it points at."""
    import h5py
    import numpy as np

    secret = b"PRIVATE-KEY-" * 64
    (tmp_path / "secret.bin").write_bytes(secret)
    rows = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "params_fp": 3})
    path = write_capture(tmp_path / "crafted.h5", rows)
    with h5py.File(path, "r+") as f:
        if how == "external storage":
            del f["steps"]
            f.create_dataset("steps", shape=rows.shape, dtype=rows.dtype,
                             external=[(str(tmp_path / "secret.bin"), 0, rows.nbytes)])
        elif how == "virtual dataset":
            with h5py.File(tmp_path / "other.h5", "w") as other:
                other["rows"] = np.frombuffer(secret[:rows.nbytes], dtype=rows.dtype)
            layout = h5py.VirtualLayout(shape=rows.shape, dtype=rows.dtype)
            layout[:] = h5py.VirtualSource(str(tmp_path / "other.h5"), "rows", shape=rows.shape)
            del f["steps"]
            f.create_virtual_dataset("steps", layout)
        else:  # an external link in place of a dump
            with h5py.File(tmp_path / "other.h5", "w") as other:
                other["values"] = np.frombuffer(secret, dtype=np.uint8)
            f["dumps"]["out"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/values")
    return path, secret


@pytest.mark.parametrize("how", ["external storage", "virtual dataset", "external link"])
def test_a_capture_pointing_at_other_files_is_refused(tmp_path: Path, how: str) -> None:
    # Trial: a crafted capture whose /steps keeps its values in another file (HDF5 external
    # storage): `nondet show` printed that file's bytes as fingerprints and losses, and
    # `diff --json` would have written them into a report meant to be shared.
    path, secret = _steps_elsewhere(tmp_path, how)
    with pytest.raises(NondetError, match=r"another file|somewhere else"):
        capture = open_capture(path)
        capture.verify()
        _ = capture.dumps
    result = run_cli("show", str(path), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout
    shown = secret[:4][::-1].hex()  # how a fingerprint column shows the first word
    assert shown not in result.stdout and "PRIVATE" not in result.stdout


def test_a_run_that_crashed_is_not_taken_for_a_clean_end_with_sigchld_ignored(
        tmp_path: Path) -> None:
    # Trial: nondet started by a launcher that ignores SIGCHLD (inherited across exec): the
    # kernel reaped the runs, `waitpid` failed with ECHILD, which subprocess reads as status
    # 0; a script that aborted after training got "deterministic", exit 0.
    import signal

    (tmp_path / "crash.py").write_text(
        "import os, signal\n"
        "ignored = signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN\n"
        "print('script sees SIGCHLD ignored:', ignored, flush=True)\n"
        "os._exit(3)\n")
    result = subprocess.run(
        [sys.executable, "-m", "nondet", "run", "--no-verify", "crash.py"], cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN))
    assert result.returncode == 2
    assert "the script failed in run a (exit code 3)" in result.stderr, result.stderr
    # the script itself runs with SIGCHLD as nondet was started (as under plain python)
    log = next((tmp_path / ".nondet").glob("*/run-a.log")).read_text()
    assert "script sees SIGCHLD ignored: True" in log


def test_nondets_sigchld_word_in_the_callers_environment_is_not_taken(tmp_path: Path) -> None:
    # Faults round 9: NONDET_SIGCHLD_IGNORED=1 in the caller's environment (nondet's word
    # to its runs) made the script ignore SIGCHLD: its `subprocess.run(["false"])` read
    # exit status 0, and nondet said "the script failed".
    (tmp_path / "probe.py").write_text(
        "import signal, subprocess\n"
        "print('ignored:', signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN, flush=True)\n"
        "assert subprocess.run(['false']).returncode == 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "nondet", "run", "--no-verify", "probe.py"], cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "NONDET_SIGCHLD_IGNORED": "1"})
    assert "the script failed" not in result.stderr, result.stderr
    log = next((tmp_path / ".nondet").glob("*/run-a.log")).read_text()
    assert "ignored: False" in log, log


def test_a_descriptor_nondet_was_given_reaches_the_script(tmp_path: Path) -> None:
    # Trial: `nondet run train.py 3>metrics.log` (plain python: the script writes its
    # metrics to descriptor 3): the runs started without it, and nondet said "the script
    # failed in run a (exit code 1): OSError: [Errno 9] Bad file descriptor".
    (tmp_path / "train.py").write_text(
        "import os, sys\nos.write(int(sys.argv[1]), b'from the script\\n')\n")
    with open(tmp_path / "metrics.log", "wb") as metrics:
        fd = metrics.fileno()
        result = subprocess.run([sys.executable, "-m", "nondet", "run", "--no-verify",
                                 "train.py", str(fd)], cwd=tmp_path, capture_output=True,
                                text=True, timeout=120, pass_fds=(fd,))
    assert "Bad file descriptor" not in result.stderr and "failed" not in result.stderr
    assert (tmp_path / "metrics.log").read_bytes() == b"from the script\n" * 2  # both runs


def test_the_jobs_socket_fits_whatever_the_temporary_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Trial: `TMPDIR=<130 characters> nondet run --nproc-per-node 2 ddp.py`: binding the
    # job's socket failed, "internal error: OSError: AF_UNIX path too long", exit 3.
    from nondet import distributed

    long_tmp = tmp_path / ("t" * 120)
    long_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    folder = distributed._socket_dir()
    try:
        assert len(os.fsencode(os.path.join(folder, "s"))) <= 107
        assert oct(os.stat(folder).st_mode & 0o777) == oct(0o700)  # still private
    finally:
        os.rmdir(folder)


@pytest.mark.e2e
def test_a_torchrun_job_runs_under_a_long_temporary_directory(tmp_path: Path) -> None:
    long_tmp = tmp_path / ("t" * 120)
    long_tmp.mkdir()
    result = run_cli("run", "--no-verify", "--nproc-per-node", "2",
                     str(FIXTURES / "ddp" / "linear_ddp.py"), cwd=tmp_path,
                     env={"TMPDIR": str(long_tmp)}, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "deterministic" in result.stdout


def test_a_failed_runs_output_is_shown_in_bounded_lines(tmp_path: Path) -> None:
    # Trial: a script that drew a progress bar with carriage returns (200 MB without a
    # newline) and then raised: nondet read the whole log (670 MB resident) and printed
    # 12 MB of it under "the script failed" (the last 15 "lines", one of them the bar).
    from nondet.schedule import check_result

    log = tmp_path / "run-a.log"
    with open(log, "wb") as out:
        for i in range(40):
            out.write(b"\rprogress %d " % i + b"#" * (1 << 20))
        out.write(b'Traceback (most recent call last):\n  File "t.py", line 5\n'
                  b"RuntimeError: boom\n")
    result = RunResult(label="a", path=tmp_path / "run-a.h5", log_path=log, status="failed",
                       exit_code=1, steps=0)
    with pytest.raises(ScriptFailed) as failed:
        check_result(result)
    details = failed.value.details
    assert len(details) < 5000 and details.endswith("RuntimeError: boom")
    assert "Traceback (most recent call last):" in details
    assert str(failed.value).startswith("the script failed in run a (exit code 1): "
                                        "RuntimeError: boom;")


def test_a_run_that_exits_without_an_exception_is_not_quoted_by_its_last_output_line(
        tmp_path: Path) -> None:
    # Trial: a TensorFlow script ending with os._exit(7) mid-fit: "the script failed in run
    # a (exit code 7): I0000 ... oneDNN custom operations are on", a start-up log line
    # quoted as the error
    from nondet.schedule import check_result

    log = tmp_path / "run-a.log"
    log.write_text("I0000 00:00 port.cc:153] oneDNN custom operations are on.\nepoch 1\n")
    result = RunResult(label="a", path=tmp_path / "run-a.h5", log_path=log, status="failed",
                       exit_code=7, steps=2)
    with pytest.raises(ScriptFailed) as failed:
        check_result(result)
    assert str(failed.value).startswith("the script failed in run a (exit code 7); its output")
    assert failed.value.details.endswith("epoch 1")  # the output is still shown below


_PAUSED_WATCH = """\
import os, signal, time
from nondet.cli._common import handle_errors
from nondet.idle import IdleWatch

with handle_errors():  # what every command runs in
    watch = IdleWatch(os.getpid(), after=1.0, cpu=lambda pid: 0.0, runnable=lambda pid: False)
    watch.idle()  # a quiet window starts
    print("stopping", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # Ctrl-Z; the test continues it 3 s later
    time.sleep(0.3)
    print("idle after the pause:", watch.idle(), flush=True)
    time.sleep(1.3)
    print("idle after a real quiet spell:", watch.idle(), flush=True)
"""


def test_time_nondet_spent_stopped_is_no_runs_silence(tmp_path: Path) -> None:
    # Trial: `kill -STOP` nondet for 135 s during a torchrun job, then `kill -CONT` (Ctrl-Z
    # and fg; Slurm's `scontrol suspend`): "ranks 0, 1 sent nothing for 135 s ... (a rank
    # hangs); the job was ended", exit 2. The idle rule and the probe's deadline counted the
    # pause the same way. The idle watch is the one shown here, in a real stop.
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_WATCH], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "stopping\n"
        deadline = time.monotonic() + 60
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(3)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "idle after the pause: False" in out, out + err
    assert "idle after a real quiet spell: True" in out


def test_a_script_given_thousands_of_arguments_runs_as_under_python(tmp_path: Path) -> None:
    # Trial: `nondet run train.py data/*.jpg` with 4,000 long file names (200 KB; python
    # runs it): "internal error: OSError: [Errno 7] Argument list too long", exit 3 (the
    # arguments travelled in one environment variable, over the kernel's 128 KiB for one
    # string), after a progress line of 200 KB.
    (tmp_path / "train.py").write_text(
        "import sys\nwith open('argc', 'a') as f:\n"
        "    f.write(f'{len(sys.argv)} {sys.argv[-1]}\\n')\n")
    args = [f"data/image_{i:06d}_with_a_long_descriptive_name.jpg" for i in range(4000)]
    result = run_cli("run", "--no-verify", "train.py", *args, cwd=tmp_path, timeout=120)
    assert "internal error" not in result.stderr and len(result.stderr) < 5000
    assert (tmp_path / "argc").read_text() == f"4001 {args[-1]}\n" * 2  # both runs, every one
    assert result.returncode == 2 and "no training step was observed" in result.stderr


def test_a_run_too_large_to_start_is_one_line() -> None:
    # what remains of the class: the environment itself too large for exec (E2BIG)
    import errno

    from nondet.cli import _trouble

    line = _trouble.explain(OSError(errno.E2BIG, "Argument list too long"))
    assert line is not None and "environment" in line
