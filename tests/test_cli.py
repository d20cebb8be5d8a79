"""Every exit code of the contract, and one clear line (never a traceback) for bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nondet.store import open_capture
from tests.conftest import REPO, OpStream, run_cli, step_rows, write_capture

STEPS = str(REPO / "tests" / "data" / "scripts" / "steps.py")


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("nondet: error")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr.split("  |")[0], stderr
    return errors[0]


def test_help_is_instant_and_names_the_exit_codes() -> None:
    start = time.monotonic()
    result = run_cli("--help")
    assert result.returncode == 0
    assert "Exit codes" in result.stdout and "130" in result.stdout
    # A fresh interpreter shows what `nondet --help` imports:
    probe = subprocess.run([sys.executable, "-c", "import sys, nondet.cli; "
                            "print(any(m in sys.modules for m in ('torch', 'tensorflow', "
                            "'h5py', 'jinja2')))"], capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "False"
    assert time.monotonic() - start < 60  # generous: only catches an accidental heavy import


def test_missing_script_argument_is_a_usage_error() -> None:
    result = run_cli("run")
    assert result.returncode == 2
    assert "missing SCRIPT" in result.stderr


def test_unknown_option_is_a_usage_error() -> None:
    result = run_cli("run", "--no-such-option", STEPS)
    assert result.returncode == 2 and "no-such-option" in result.stderr


def test_script_not_found(tmp_path: Path) -> None:
    result = run_cli("run", str(tmp_path / "missing.py"), cwd=tmp_path)
    assert result.returncode == 2
    assert "script not found" in _one_error_line(result.stderr)


def test_script_failure_is_reported_in_one_line_with_its_error(tmp_path: Path) -> None:
    result = run_cli("run", "-q", STEPS, "--fail-at", "1", cwd=tmp_path)
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert "the script failed in run a" in line and "ValueError: boom at step 1" in line
    # The capture of the failed run is still readable and says how the run ended.
    capture = open_capture(tmp_path / ".nondet" / "latest" / "run-a.h5")
    assert capture.status == "failed" and capture.n_steps == 1


def test_killed_run_leaves_a_readable_capture(tmp_path: Path) -> None:
    result = run_cli("run", "-q", STEPS, "--steps", "5", "--kill-at", "2", cwd=tmp_path)
    assert result.returncode == 2
    assert "killed by signal 9" in _one_error_line(result.stderr)
    capture = open_capture(tmp_path / ".nondet" / "latest" / "run-a.h5")
    assert capture.status == "crashed" and capture.n_steps == 2 and not capture.complete


def test_deterministic_script_exits_0_with_identical_runs(tmp_path: Path) -> None:
    result = run_cli("run", "-q", "--json", "r.json", STEPS, "--steps", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("nondet: deterministic")
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "deterministic" and report["first_divergence"] is None
    assert [r["steps"] for r in report["runs"]] == [3, 3]
    assert report["runs"][0]["final_params_fp"] == report["runs"][1]["final_params_fp"]


def test_an_output_option_after_the_script_is_named_as_the_scripts(tmp_path: Path) -> None:
    """Trial round 18: `nondet run train.py --json r.json` passed --json to a script that
    ignores arguments it does not know: no report, and no word why."""
    from tests.conftest import tiny_training

    script = tmp_path / "train.py"
    script.write_text(tiny_training(2))
    result = run_cli("run", "-q", "--no-verify", str(script), "--json", "r.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("nondet: note: --json after the script is the script's argument; for nondet's "
            "report, put --json before the script") in result.stderr
    assert not (tmp_path / "r.json").exists()  # the script's argument, as before
    given = run_cli("run", "-q", "--no-verify", "--json", "own.json", str(script), "--json",
                    "r.json", cwd=tmp_path)
    assert given.returncode == 0 and "note: --json" not in given.stderr, given.stderr


def test_module_form_runs_like_python_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text((REPO / "tests/data/scripts/steps.py").read_text())
    result = run_cli("run", "-q", "-m", "pkg.train", "--steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "2 steps" in result.stdout or "(2, 2 steps)" in result.stdout


def test_max_steps_bounds_both_runs(tmp_path: Path) -> None:
    result = run_cli("run", "-q", "--max-steps", "2", "--json", "r.json", STEPS, "--steps", "6",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    import json

    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [r["steps"] for r in runs] == [2, 2] and all(r["complete"] for r in runs)


@pytest.mark.parametrize("command", ["run", "check"])
def test_ctrl_c_exits_130_and_keeps_readable_captures(tmp_path: Path, command: str) -> None:
    env = {**os.environ, "NO_COLOR": "1"}
    quiet = ["-q"] if command == "run" else []
    proc = subprocess.Popen([sys.executable, "-m", "nondet", command, *quiet, STEPS, "--steps",
                             "200", "--sleep", "0.05"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until run A has finished a few steps
        time.sleep(0.2)
        logs = list((tmp_path / ".nondet").glob("*/run-a.log"))
        if logs and "step 3 done" in logs[0].read_text():
            break
    assert proc.poll() is None, "the run ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    capture = open_capture(tmp_path / ".nondet" / "latest" / "run-a.h5")
    assert capture.status == "interrupted" and capture.n_steps >= 1


def test_sigint_to_nondet_alone_ends_the_runs_as_interrupted(tmp_path: Path) -> None:
    """``kill -INT`` of nondet alone (a CI runner cancelling a job) does not reach the runs
    as Ctrl-C does: nondet sends them SIGINT after a short wait. They end as interrupted,
    not terminated by the SIGTERM that came ten seconds later."""
    proc = subprocess.Popen([sys.executable, "-m", "nondet", "run", "-q", STEPS, "--steps",
                             "400", "--sleep", "0.05"], cwd=tmp_path,
                            env={**os.environ, "NO_COLOR": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.2)
        logs = list((tmp_path / ".nondet").glob("*/run-a.log"))
        if logs and "step 3 done" in logs[0].read_text():
            break
    assert proc.poll() is None, "the run ended before it could be interrupted"
    os.kill(proc.pid, signal.SIGINT)  # nondet's process only, not its group
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    for label in "ab":
        capture = open_capture(tmp_path / ".nondet" / "latest" / f"run-{label}.h5")
        assert capture.status == "interrupted", (label, capture.status)
        # ended on a SIGINT of its own (exit 130), not on the SIGTERM nondet sends a run
        # still there after waiting ten seconds for a Ctrl-C that never reached it
        assert capture.exit_code == 130, (label, capture.exit_code)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_sigint_forwarded_twice_by_timeout_leaves_readable_captures(tmp_path: Path) -> None:
    """Faults round 9: under `timeout`, a Ctrl-C reaches nondet twice or thrice (from the
    terminal, and forwarded by `timeout`). The second KeyboardInterrupt cut the clean-up
    short: runs left going, captures damaged (3 of 4 tries), "release unlocked lock"
    (exit 3), or a hang at exit. The clean-up now finishes."""
    for attempt in range(2):
        out = tmp_path / f"out{attempt}"
        proc = subprocess.Popen(["timeout", "120", sys.executable, "-m", "nondet", "run", "-q",
                                 "--out", str(out), "--json", f"r{attempt}.json", STEPS,
                                 "--steps", "400", "--sleep",
                                 "0.05"], cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.1)
            logs = list(out.glob("*/run-a.log"))
            if logs and f"step {2 + attempt} done" in logs[0].read_text():
                break
        assert proc.poll() is None, "the run ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)  # timeout and nondet both get it; timeout forwards
        _, stderr = proc.communicate(timeout=90)
        assert proc.returncode == 130, stderr
        assert "internal error" not in stderr and "Traceback" not in stderr, stderr
        for label in "ab":
            capture = open_capture(out / "latest" / f"run-{label}.h5")
            assert capture.status == "interrupted", (label, capture.status)
        # the JSON names them, for `nondet diff` (it said `captures: []`)
        report = json.loads((tmp_path / f"r{attempt}.json").read_text())
        assert report["exit_code"] == 130 and [Path(c).name for c in report["captures"]] == [
            "run-a.h5", "run-b.h5"], report


def test_the_terminal_foreground_is_told_from_a_job_without_one() -> None:
    """In a terminal's foreground Ctrl-C reached the runs too (nondet waits for them, and
    sends no second SIGINT); without one (CI, a background job) it may not have."""
    import pty

    probe = "import nondet.launch as l; print('foreground', l._terminal_foreground())"
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own, the pty its controlling terminal
        os.execv(sys.executable, [sys.executable, "-c", probe])
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1024)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    os.close(fd)
    assert b"foreground True" in out, out
    alone = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           start_new_session=True, cwd=REPO, timeout=60)
    assert "foreground False" in alone.stdout, alone.stderr


def _two_captures(tmp_path: Path, differ: bool) -> tuple[Path, Path]:
    ops = OpStream().add(0, "aten.mm.default", 5, 1, source="train.py:3")
    other = OpStream().add(0, "aten.mm.default", 6 if differ else 5, 1, source="train.py:3")
    steps = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "grads_fp": 2})
    steps_b = steps.copy()
    if differ:
        steps_b[1]["grads_fp"] = 3
    return (write_capture(tmp_path / "a.h5", steps, ops),
            write_capture(tmp_path / "b.h5", steps_b, other))


def test_diff_of_identical_captures_exits_0(tmp_path: Path) -> None:
    a, b = _two_captures(tmp_path, differ=False)
    result = run_cli("diff", str(a), str(b))
    assert result.returncode == 0 and result.stdout.startswith("nondet: deterministic")


def test_diff_of_captures_of_different_scripts_says_so(tmp_path: Path) -> None:
    a, _ = _two_captures(tmp_path, differ=False)
    steps = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "grads_fp": 2})
    other = write_capture(tmp_path / "c.h5", steps, attrs={"script": "other.py",
                                                            "script_sha256": "beef"})
    result = run_cli("diff", str(a), str(other))
    assert "different scripts" in result.stderr and "other.py" in result.stderr


def test_diff_of_differing_captures_exits_1_and_names_the_op(tmp_path: Path) -> None:
    a, b = _two_captures(tmp_path, differ=True)
    result = run_cli("diff", "--json", str(tmp_path / "r.json"), str(a), str(b))
    assert result.returncode == 1
    assert "aten.mm.default" in result.stdout.splitlines()[0]


@pytest.mark.parametrize("command", ["diff", "show"])
def test_unreadable_capture_is_exit_2(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    args = [command, str(bad)] + ([str(bad)] if command == "diff" else [])
    result = run_cli(*args)
    assert result.returncode == 2
    assert "cannot read" in _one_error_line(result.stderr)


def test_show_prints_tables(tmp_path: Path) -> None:
    a, _ = _two_captures(tmp_path, differ=False)
    result = run_cli("show", str(a), "--ops", "0")
    assert result.returncode == 0, result.stderr
    assert "aten.mm.default" in result.stdout and "train.py:3" in result.stdout


@pytest.mark.parametrize("count", ["-1", "0", "1"])
def test_show_refuses_a_step_count_it_cannot_show(tmp_path: Path, count: str) -> None:
    # Trial: `show --steps -1` (or 0, 1) printed duplicated rows and misplaced "..." rows
    a, _ = _two_captures(tmp_path, differ=False)
    result = run_cli("show", "--steps", count, str(a))
    assert result.returncode == 2 and "--steps" in result.stderr, result.stdout


def test_internal_error_exits_3_and_writes_a_log(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from nondet import analysis, cli

    a, b = _two_captures(tmp_path, differ=False)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(analysis, "compare_captures", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["nondet", "diff", str(a), str(b)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 3
    logs = list((tmp_path / "cache" / "nondet").glob("nondet-*.log"))
    assert len(logs) == 1 and "simulated bug" in logs[0].read_text()


# -- the user's files, and one invocation's captures per invocation -------------------------
def _user_files(root: Path) -> dict[Path, tuple[bytes, int]]:
    files = [root / "run-notes.log", root / "run-experiment.h5", root / "run-a.h5",
             root / "run-b.log", root / "run-baseline.h5", root / "sub" / "run-a.h5"]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"the user's own {path.name}".encode())
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


@pytest.mark.parametrize("out", [".", ".nondet"])
def test_user_files_in_out_are_never_modified_or_deleted(tmp_path: Path, out: str) -> None:
    before = _user_files(tmp_path / out)
    result = run_cli("run", "-q", "--out", out, "--json", "r.json", STEPS, "--steps", "2",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in before} == before
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    paths = [tmp_path / r["path"] for r in report["runs"]]
    assert len({p.parent for p in paths}) == 1 and paths[0].parent.parent == tmp_path / out
    assert [open_capture(p).n_steps for p in paths] == [2, 2]
    assert (tmp_path / out / "latest").resolve() == paths[0].parent.resolve()


def test_two_concurrent_runs_in_one_directory_report_their_own_captures(
        tmp_path: Path) -> None:
    env = {**os.environ, "NO_COLOR": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "nondet", "run", "-q", "--json",
                               f"r{steps}.json", STEPS, "--steps", str(steps), "--sleep",
                               "0.05"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for steps in (6, 3)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    import json

    for proc, (_, stderr), steps in zip(procs, outputs, (6, 3), strict=True):
        assert proc.returncode == 0, stderr
        runs = json.loads((tmp_path / f"r{steps}.json").read_text())["runs"]
        captures = [open_capture(tmp_path / r["path"]) for r in runs]
        assert [r["steps"] for r in runs] == [steps, steps]
        assert [c.n_steps for c in captures] == [steps, steps]
        assert all(c.complete for c in captures)
    paths = {json.loads((tmp_path / f"r{s}.json").read_text())["runs"][0]["path"]
             for s in (6, 3)}
    assert len(paths) == 2


# -- exit codes that tell the truth ---------------------------------------------------------
@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**64)])
def test_seed_out_of_range_is_a_usage_error(tmp_path: Path, seed: str) -> None:
    result = run_cli("run", "-q", "--seed", seed, STEPS, "--steps", "1", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--seed" in result.stderr and "4294967295" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["run", "check"])
def test_verify_pairs_beyond_the_bound_is_a_usage_error(tmp_path: Path, command: str) -> None:
    """Each pair is two whole runs per fix tried, outside --verify-budget: a count like
    1000000 would run for ever, so it is refused before any run."""
    result = run_cli(command, "-q", "--verify-pairs", "1000000", STEPS, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--verify-pairs" in result.stderr and "20" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / ".nondet").exists()  # refused before the runs


def test_out_under_a_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = run_cli("run", "-q", "--out", "file/captures", STEPS, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "file is a file, not a directory" in _one_error_line(result.stderr)


def test_a_file_named_like_the_default_out_is_one_line_naming_the_option(
        tmp_path: Path) -> None:
    (tmp_path / ".nondet").write_text("the user's own file\n")
    result = run_cli("run", "-q", STEPS, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result.stderr)
    assert ".nondet is a file, not a directory" in line and "give --out a directory" in line
    assert (tmp_path / ".nondet").read_text() == "the user's own file\n"


def test_json_under_a_file_is_refused_before_running(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = run_cli("run", "-q", "--json", "file/missing/r.json", STEPS, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--json file/missing/r.json" in _one_error_line(result.stderr)
    assert not (tmp_path / ".nondet").exists()  # refused before anything ran


def test_unwritable_json_after_the_run_prints_the_report_then_exits_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # As root a read-only directory does not stop a write, so the write itself fails here.
    from nondet import cli
    from nondet.report import json_file

    def read_only(*args: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(json_file, "write", read_only)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["nondet", "run", "-q", "--json", "r.json", STEPS,
                                      "--steps", "1"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, err
    assert out.startswith("nondet: deterministic")
    assert "cannot write --json r.json: Permission denied" in _one_error_line(err)


def test_non_utf8_script_path_is_one_line_and_exit_2(tmp_path: Path) -> None:
    name = os.fsdecode(b"train-\xff.py")
    (tmp_path / name).write_text((REPO / "tests/data/scripts/steps.py").read_text())
    result = subprocess.run([sys.executable, "-m", "nondet", "run", "-q", name], cwd=tmp_path,
                            capture_output=True, env={**os.environ, "NO_COLOR": "1"})
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, stderr
    assert "not UTF-8 (train-\\xff.py)" in _one_error_line(stderr)


def test_bug_log_of_a_non_utf8_command_line(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from nondet.cli._common import write_bug_log

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["nondet", "run", os.fsdecode(b"\xfe.py")])
    log = write_bug_log("Traceback: " + os.fsdecode(b"\xfe"))
    assert "run \\xfe.py" in log.read_text(encoding="utf-8")


def test_unknown_option_before_the_script_says_no_such_option(tmp_path: Path) -> None:
    result = run_cli("run", "--bogus-option", STEPS, cwd=tmp_path)
    assert result.returncode == 2
    assert "no such option: --bogus-option" in result.stderr
    assert "script not found" not in result.stderr


def test_a_script_named_like_an_option_runs_after_double_dash(tmp_path: Path) -> None:
    (tmp_path / "-x.py").write_text((REPO / "tests/data/scripts/steps.py").read_text())
    refused = run_cli("run", "-q", "-x.py", cwd=tmp_path)
    assert refused.returncode == 2 and "no such option: -x.py" in refused.stderr
    result = run_cli("run", "-q", "--", "-x.py", "--steps", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", ["run", "check"])
def test_a_script_named_like_an_option_holding_an_h_is_not_a_help_request(
        tmp_path: Path, command: str) -> None:
    # click read the h of "-dash.py" as -h: help and exit 0 (a CI pass for `check`)
    (tmp_path / "-dash.py").write_text((REPO / "tests/data/scripts/steps.py").read_text())
    refused = run_cli(command, "-dash.py", cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout
    assert "no such option: -dash.py" in refused.stderr
    for asked in (["-h"], ["--help"], ["--seed", "3", "-h"]):
        helped = run_cli(command, *asked, cwd=tmp_path)
        assert helped.returncode == 0 and helped.stdout.startswith("Usage:"), helped.stderr


_INTERRUPTED_IMPORT = """
import builtins
real_import = builtins.__import__

def interrupted(name, *args, **kwargs):
    if name == "click":  # Ctrl-C while the command line is still being imported
        raise KeyboardInterrupt
    return real_import(name, *args, **kwargs)

builtins.__import__ = interrupted
from nondet.entry import main
main()
"""


def test_ctrl_c_while_nondet_is_imported_is_one_line_and_130() -> None:
    # Trial: SIGINT about 0.2 s after `nondet run` started printed a KeyboardInterrupt
    # traceback (the exit code, 130, was right)
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert (done.returncode, done.stderr) == (130, "nondet: interrupted\n"), done.stderr
