"""Faults, fourth round (FINDINGS.md): how nondet ends when it is told to (or made to) in
ways no other test covers (SIGHUP; SIGKILL of nondet itself, whose runs must not train on as
orphans; a stdout that refuses writes; what `check` leaves for CI when terminated), and
paths that cannot name a file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nondet import channel
from nondet.errors import Terminated
from tests.conftest import run_cli, step_rows, write_capture

_ENV = {**os.environ, "NO_COLOR": "1"}


def test_sighup_ends_nondet_as_sigterm_does() -> None:
    # Trial: `kill -HUP` (a closed terminal or ssh session) killed nondet at once: its runs
    # trained on as orphans and both captures stayed open for writing, unreadable
    code = textwrap.dedent("""
        import os, signal, time
        from nondet.cli._common import handle_errors
        with handle_errors():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(30)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=_ENV)
    assert done.returncode == 143, (done.returncode, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "terminated (SIGHUP)" in lines[0], done.stderr


def test_nohup_leaves_sighup_ignored() -> None:
    # Control: under `nohup nondet ...` SIGHUP stays ignored (the run goes on)
    code = textwrap.dedent("""
        import os, signal
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        from nondet.cli._common import handle_errors
        with handle_errors():
            os.kill(os.getpid(), signal.SIGHUP)
        print("went on")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=_ENV)
    assert done.returncode == 0 and "went on" in done.stdout, done.stderr


def test_a_child_reads_a_closed_control_pipe_as_its_parent_gone() -> None:
    # Before: end of file counted as FREE (lockstep) or as nothing (sequential): a run whose
    # nondet was killed (SIGKILL, the OOM killer) trained on for nobody, for good if the
    # script never ends on its own
    # (lockstep's wait_for_turn: tests/test_channel.py)
    r, w = os.pipe()
    os.close(w)
    try:
        assert channel.stop_requested(r)
    finally:
        os.close(r)


def test_a_control_pipe_without_a_word_is_not_a_stop() -> None:
    # Control: the parent is there and silent
    r, w = os.pipe()
    try:
        assert not channel.stop_requested(r)
        assert channel.wait_for_grant(r, lambda step, index: None, timeout=0.2)[0] == \
            channel.FREE
    finally:
        os.close(r)
        os.close(w)


def test_a_frame_writer_whose_reader_is_gone_says_so() -> None:
    r, w = os.pipe()
    os.close(r)
    writer = channel.FrameWriter(w)
    writer.send(channel.META, b"{}")
    writer.flush()  # EPIPE: Python ignores SIGPIPE, so it is an error, not a death
    assert writer.parent_gone
    writer.close()


# Never prints (a print to the gone parent's pipe would end it with EPIPE whatever nondet
# does) and never ends on its own in the test's time; a marker once it trains.
_FOREVER = """
import os, time, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100000):
    loss = model(torch.ones(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 2:
        open("training", "w").close()
    time.sleep(0.05)
"""


@pytest.mark.e2e
def test_runs_of_a_nondet_killed_by_sigkill_stop_instead_of_training_on(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_FOREVER)
    proc = subprocess.Popen([sys.executable, "-m", "nondet", "run", "-q", "train.py"],
                            cwd=tmp_path, env=_ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "training").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)],
                             capture_output=True, text=True, check=False).stdout
        children = [int(p) for p in out.split()]
        assert children and proc.poll() is None, "the runs ended before nondet was killed"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 90  # interpreter teardown under load takes seconds
        while time.monotonic() < deadline and any(_alive(pid) for pid in children):
            time.sleep(0.5)
        assert not [pid for pid in children if _alive(pid)], "orphaned runs still training"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a failed test leaves nothing behind
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended (its parent, killed, cannot reap it)


@pytest.mark.parametrize("command", [["fixes"], ["diff", "a.h5", "b.h5"]])
def test_a_stdout_that_refuses_writes_is_one_line_not_an_internal_error(
        tmp_path: Path, command: list[str]) -> None:
    # Trial: `nondet fixes > /dev/full` (or `> report.txt` on a full disk) was "internal
    # error: OSError: [Errno 28] No space left on device", exit 3 and a bug log
    write_capture(tmp_path / "a.h5", step_rows({"step": 0, "loss": 0.5, "params_fp": 3}))
    write_capture(tmp_path / "b.h5", step_rows({"step": 0, "loss": 0.5, "params_fp": 3}))
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "nondet", *command], cwd=tmp_path,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                              env=_ENV)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "could not write the report to stdout" in lines[0], lines
    assert "No space left on device" in lines[0]


def test_a_terminated_check_leaves_terminated_for_ci_not_an_internal_error(
        tmp_path: Path) -> None:
    # Before: the JUnit and JSON of a check cancelled by SIGTERM said "internal error in
    # nondet: Terminated", exit_code 3, while the process exited 143
    from nondet.cli.failure import write_failure

    write_failure(Terminated(signal.SIGTERM), "nondet check", 1.0, tmp_path / "j.xml",
                  tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["exit_code"] == 143 and report["verdict"] == "error", report
    assert "internal" not in (tmp_path / "j.xml").read_text()
    assert "terminated (SIGTERM)" in (tmp_path / "j.xml").read_text()


def test_a_run_without_a_verdict_still_writes_its_json(tmp_path: Path) -> None:
    # Trial: `nondet run --json r.json` of a script that fails (exit 2) wrote no file, where
    # `check --json` writes verdict "error": a CI step reading the run's JSON found nothing
    (tmp_path / "train.py").write_text("raise SystemExit('boom')\n")
    (tmp_path / "mine.json").write_text("the user's")
    done = run_cli("run", "-q", "--json", "r.json", "train.py", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["verdict"], report["exit_code"]) == ("error", 2)
    assert "the script failed in run a" in report["notes"][0]
    # the captures written before it failed are listed, as a report with a verdict lists them
    # (they were left out: `captures: []`, so CI had nothing to point `nondet diff` at)
    assert report["captures"], report
    assert all((tmp_path / c).is_file() and c.endswith(".h5") for c in report["captures"])
    missing = run_cli("run", "-q", "--json", "mine.json", "gone.py", cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and "script not found" in missing.stderr
    assert (tmp_path / "mine.json").read_text() == "the user's"  # never over a user's file


@pytest.mark.parametrize("option", [[], ["--out"], ["--json"], ["--html"]])
def test_a_path_too_long_to_be_a_file_name_is_one_line(tmp_path: Path,
                                                      option: list[str]) -> None:
    # Trial: a name over 255 bytes for the script, --out, --json, --html, --baseline, or a
    # capture of show/diff/report was "internal error: OSError: [Errno 36]", exit 3
    (tmp_path / "train.py").write_text("print(1)\n")
    long_name = "n" * 300
    args = [*option, long_name, "train.py"] if option else [long_name + ".py"]
    done = run_cli("run", "-q", *args, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "File name too long" in lines[0], lines


@pytest.mark.parametrize("script", ["/dev/stdin", "loop.py"])
def test_a_script_path_no_run_can_open_as_meant_is_one_line(tmp_path: Path,
                                                           script: str) -> None:
    # Trial: `nondet run /dev/stdin < train.py` ran an empty script (each run has stdin of
    # its own) and blamed it: "no training step was observed ... check that the script
    # trains"; a symlink loop was "script not found"
    (tmp_path / "loop.py").symlink_to("loop2.py")
    (tmp_path / "loop2.py").symlink_to("loop.py")
    (tmp_path / "train.py").write_text("print(1)\n")
    with open(tmp_path / "train.py") as stdin:
        done = subprocess.run([sys.executable, "-m", "nondet", "run", "-q", script],
                              cwd=tmp_path, stdin=stdin, capture_output=True, text=True,
                              timeout=120, env=_ENV)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"the script {script} is" in lines[0], lines


def test_a_capture_being_written_or_left_open_is_not_called_damaged(tmp_path: Path) -> None:
    # Trial: `nondet show` on a capture a running nondet was writing, or one left by a nondet
    # killed with SIGKILL, said "not an HDF5 file or truncated ...; re-capture it"
    import shutil

    import h5py

    writing = h5py.File(tmp_path / "run-a.h5", "w", libver=("v110", "v110"))  # as the writer
    try:
        writing.attrs["x"] = 1
        writing.flush()
        shutil.copy(tmp_path / "run-a.h5", tmp_path / "killed.h5")  # what SIGKILL leaves
        being_written = run_cli("show", "run-a.h5", cwd=tmp_path, timeout=120)
        left_open = run_cli("show", "killed.h5", cwd=tmp_path, timeout=120)
    finally:
        writing.close()
    assert being_written.returncode == 2 and left_open.returncode == 2
    assert "another process is writing it" in being_written.stderr, being_written.stderr
    # read past the open mark (tests/test_unclosed_capture.py): this one holds no capture
    assert "not a nondet capture" in left_open.stderr, left_open.stderr
    assert "truncated" not in left_open.stderr


def test_the_scripts_own_excepthook_gets_what_it_did_not_catch(tmp_path: Path) -> None:
    # Trial: a script that sets sys.excepthook (a logger, an error tracker) and then raises:
    # under nondet its hook was never called, and the traceback began in nondet/boot.py
    from tests.test_run_process import _run_script

    marker = tmp_path / "hooked.txt"
    run, _ = _run_script(tmp_path, f"""
        import sys
        def hook(kind, value, tb):
            open({str(marker)!r}, "w").write(f"{{kind.__name__}}: {{value}}")
            sys.__excepthook__(kind, value, tb)
        sys.excepthook = hook
        raise ValueError("after training")
    """)
    assert marker.read_text() == "ValueError: after training"
    assert run.end is not None and run.end.status == "failed"
    assert "boot.py" not in run.end.error and "train.py" in run.end.error, run.end.error


@pytest.mark.parametrize("option", ["--junit", "--json"])
def test_a_forgotten_report_path_never_overwrites_the_script(tmp_path: Path,
                                                            option: str) -> None:
    # Trial: `nondet check --junit train.py` (the JUnit path forgotten) took the script for
    # it and wrote the JUnit XML of the usage error over the user's train.py
    script = tmp_path / "train.py"
    script.write_text("print('my script')\n")
    done = run_cli("check", option, "train.py", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert script.read_text() == "print('my script')\n"


def test_a_report_path_naming_a_file_of_the_users_is_refused_and_a_report_is_replaced(
        tmp_path: Path) -> None:
    (tmp_path / "notes.json").write_text('{"mine": 1}\n')
    (tmp_path / "old.json").write_text('{\n  "nondet_report_version": 1\n}\n')  # a report
    write_capture(tmp_path / "a.h5", step_rows({"step": 0, "loss": 0.5, "params_fp": 3}))
    write_capture(tmp_path / "b.h5", step_rows({"step": 0, "loss": 0.5, "params_fp": 3}))
    refused = run_cli("diff", "--json", "notes.json", "a.h5", "b.h5", cwd=tmp_path,
                      timeout=120)
    assert refused.returncode == 2 and "no report of nondet's" in refused.stderr
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}\n'
    replaced = run_cli("diff", "--json", "old.json", "a.h5", "b.h5", cwd=tmp_path,
                       timeout=120)
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads((tmp_path / "old.json").read_text())["verdict"] == "deterministic"


def test_update_baseline_writes_over_a_capture_but_never_over_a_file_of_the_users(
        tmp_path: Path) -> None:
    # Trial: `nondet check --update-baseline --baseline victim.py train.py` wrote HDF5 over
    # victim.py (and would over a Keras `model.h5` given for the baseline)
    from nondet.cli._options import check_output_file
    from nondet.errors import NondetError

    old = write_capture(tmp_path / "baseline.h5", step_rows({"step": 0, "params_fp": 3}))
    check_output_file(old, "--baseline")  # an earlier baseline: updated in place
    for name, content in (("victim.py", b"print(1)\n"), ("model.h5", b"\x89HDF\r\n\x1a\n" * 9)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(NondetError, match="no capture of nondet's"):
            check_output_file(tmp_path / name, "--baseline")


def test_a_bug_whose_log_cannot_be_written_is_still_exit_3_with_its_traceback() -> None:
    # Trial: an internal error with the cache and the current directory on a read-only file
    # system raised inside the error handler: two tracebacks and exit 1 ("nondeterminism
    # found" to CI) for a bug
    code = textwrap.dedent("""
        import errno, pathlib
        def refuse(self, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        pathlib.Path.write_text = refuse
        from nondet.cli._common import handle_errors
        with handle_errors():
            raise RuntimeError("a bug")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=_ENV)
    assert done.returncode == 3, done.stderr
    assert "no log could be written" in done.stderr and "RuntimeError: a bug" in done.stderr
    assert "During handling" not in done.stderr


@pytest.mark.parametrize(("args", "code"), [("show nothere.h5", 2), ("diff a.h5 b.h5", 0)])
def test_closed_standard_streams_keep_the_commands_exit_code(tmp_path: Path, args: str,
                                                             code: int) -> None:
    # Trial: `nondet ... >&- 2>&-` (cron, a service) was "internal error: AttributeError:
    # 'NoneType' object has no attribute 'isatty'" and exit 120, whatever the verdict
    write_capture(tmp_path / "a.h5", step_rows({"step": 0, "loss": 0.5, "params_fp": 3}))
    write_capture(tmp_path / "b.h5", step_rows({"step": 0, "loss": 0.5, "params_fp": 3}))
    done = subprocess.run(["sh", "-c", f'exec "$0" -m nondet {args} <&- >&- 2>&-',
                           sys.executable], cwd=tmp_path, timeout=120, env=_ENV)
    assert done.returncode == code


def test_a_deleted_current_directory_is_one_line_for_every_command(tmp_path: Path) -> None:
    # Trial: `nondet diff a b` from a directory deleted under the shell printed its verdict,
    # then failed inside the error handler (Path.cwd() in the bug log): exit 1
    write_capture(tmp_path / "a.h5", step_rows({"step": 0, "loss": 0.5, "params_fp": 3}))
    write_capture(tmp_path / "b.h5", step_rows({"step": 0, "loss": 0.5, "params_fp": 3}))
    gone = tmp_path / "gone"
    gone.mkdir()
    done = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$0" -m nondet diff '
                           '"$2" "$3"', sys.executable, str(gone), str(tmp_path / "a.h5"),
                           str(tmp_path / "b.h5")], capture_output=True, text=True,
                          timeout=120, env=_ENV)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "the current directory is gone" in lines[0], lines


def test_help_answers_in_a_deleted_current_directory(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    done = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$0" -m nondet --help',
                           sys.executable, str(gone)], capture_output=True, text=True,
                          timeout=120, env=_ENV)
    assert done.returncode == 0, done.stderr
    assert "Find where run-to-run nondeterminism" in done.stdout
