"""Faults, sixth round (FINDINGS.md): text from the user's program reaching the terminal raw,
a script written just before nondet started noted as another run's output, and more."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from nondet import outdir, readback
from nondet.cli import _common
from nondet.cli._common import SafeConsole
from nondet.cli._options import invocation
from nondet.errors import NondetError
from nondet.exitcodes import ExitCode
from nondet.progress import Progress
from nondet.report import ContextLine, Divergence, Report, RunSummary, text
from nondet.store import open_capture
from tests.conftest import run_cli, step_rows, write_capture
from tests.test_readback import _run
from tests.test_unclosed_capture import _killed_capture

_CLEAR = "\x1b[2J"  # "clear the screen": what a hostile name would do to the terminal


def test_a_scripts_name_and_its_error_reach_the_terminal_escaped(tmp_path: Path) -> None:
    # Trial: a script named $'a\x1b[2Jb.py' raising RuntimeError("boom\x1b[2J\rEVIL"): the
    # progress line and the traceback under the error passed the ESC through, and the
    # error's summary was "EVIL" (splitlines cut the message at the carriage return)
    script = tmp_path / f"a{_CLEAR}b.py"
    script.write_text('raise RuntimeError("boom\\x1b[2J\\x1b]0;title\\x07\\rEVIL")\n')
    result = run_cli("run", "--no-verify", script.name, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "\x1b" not in result.stderr + result.stdout
    assert "\x07" not in result.stderr and "\rEVIL" not in result.stderr
    assert "(exit code 1): RuntimeError: boom" in result.stderr


def test_a_usage_error_quoting_a_hostile_argument_is_escaped_on_a_terminal(
        tmp_path: Path) -> None:
    # click's usage error quotes the value typed (`--apply $'x\x1b[2J'`); click strips escape
    # sequences only when stderr is no terminal, so on one they arrived raw
    main, terminal = pty.openpty()
    try:
        result = subprocess.run([sys.executable, "-m", "nondet", "run", "--apply", f"x{_CLEAR}",
                                 "train.py"], cwd=tmp_path, stderr=terminal,
                                stdout=subprocess.DEVNULL, timeout=60)
        os.close(terminal)
        shown = b""
        while select.select([main], [], [], 1)[0]:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(main)
    assert result.returncode == 2
    assert b"Invalid value for --apply" in shown
    assert _CLEAR.encode() not in shown


def test_the_consoles_replace_control_characters_and_keep_their_styles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    buffer = io.StringIO()
    console = SafeConsole(file=buffer, force_terminal=True, color_system="standard",
                          highlight=False)
    console.print(f"[red]nondet:[/] a{_CLEAR}b\rc\nd")
    shown = buffer.getvalue()
    assert _CLEAR not in shown and "\r" not in shown
    assert "\x1b[31m" in shown  # rich's own colour is still drawn
    assert "\nd" in shown  # a message may span lines


def test_a_live_status_line_replaces_control_characters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm")  # rich draws no live display on a dumb terminal
    buffer = io.StringIO()
    console = SafeConsole(file=buffer, force_terminal=True, color_system=None)
    with Progress(console) as progress:
        progress.status(f"run a of a{_CLEAR}b.py: step 1")
        progress.status(f"run a of a{_CLEAR}b.py: step 2")  # an update, not a new status
        console.print("a line")  # draws the live status above it
    assert _CLEAR not in buffer.getvalue()


def test_a_script_written_a_moment_before_nondet_started_is_no_runs_output(
        tmp_path: Path) -> None:
    # Trial: `cp base.py x.py; nondet run x.py` noted "a run read x.py, written by an earlier
    # run of this nondet invocation ... verified above does not show the fix works" for a
    # deterministic script: the one-second slack for coarse file systems counted the script
    now = time.time()
    invocation = now - 10
    fine = tmp_path / "train_copy.py"
    fine.write_text("x = 1\n")
    moment = int((invocation - 0.4) * 1e9)
    os.utime(fine, ns=(moment, moment))
    # the same moment on a file system that keeps whole seconds: may be a run's (rounded)
    coarse = tmp_path / "coarse.py"
    coarse.write_text("x = 1\n")
    whole = int(invocation) * 1_000_000_000
    os.utime(coarse, ns=(whole, whole))
    code = "open('train_copy.py').read(); open('coarse.py').read()"
    facts = _run(tmp_path, code, run_started=now, invocation=invocation)
    keys = [k for k in facts if k.startswith(f"capture_note.{readback.FACT}")]
    assert keys == [f"capture_note.{readback.FACT}:coarse.py"]


def test_an_interrupted_invocation_says_how_to_compare_what_it_recorded(
        tmp_path: Path) -> None:
    # Trial: a script that trains and then never ends (a server, `while True: sleep`),
    # stopped with Ctrl-C: "nondet: interrupted", and nothing said the two captures hold the
    # steps both runs recorded, comparable with `nondet diff`
    with pytest.raises(KeyboardInterrupt) as interrupt, invocation(tmp_path / "my out") as own:
        for label in "ab":
            (own / f"run-{label}.h5").write_bytes(b"")
        raise KeyboardInterrupt
    abort = click.exceptions.Abort()  # click wraps Ctrl-C in its own Abort
    abort.__context__ = interrupt.value
    line = _common._kept(abort)
    assert f"`nondet diff '{own / 'run-a.h5'}' '{own / 'run-b.h5'}'`" in line
    assert _common._kept(KeyboardInterrupt()) == ""  # before any directory was made


def test_a_capture_a_running_nondet_writes_is_not_read_with_locking_off(
        tmp_path: Path) -> None:
    # Trial: `HDF5_USE_FILE_LOCKING=FALSE nondet show` (file locking is often off on network
    # file systems) of a capture a live `nondet run` was writing: HDF5 could not tell it from
    # a killed writer's, the overlay read it mid-write: "damaged capture ... re-capture it"
    folder = tmp_path / "20261125-025515-4242"
    folder.mkdir()
    path = _killed_capture(folder / "run-a.h5")  # marked open for writing, as mid-write
    writer = subprocess.Popen([sys.executable, "-c", "print(); import time; time.sleep(60)",
                               "nondet"], stdout=subprocess.PIPE)  # a live nondet, as /proc says
    try:
        assert writer.stdout is not None
        writer.stdout.readline()  # it runs python now (before, /proc showed the forked pytest)
        (folder / outdir.MARKER).write_text(json.dumps(
            {"magic": outdir.MAGIC, "pid": writer.pid, "host": socket.gethostname()}))
        with pytest.raises(NondetError, match="another process is writing it"):
            open_capture(path)
    finally:
        writer.kill()
        writer.wait()
    assert open_capture(path).status == "interrupted"  # its writer gone: read as before


@pytest.mark.parametrize("target", ["elsewhere/gone", "loop"])
def test_an_out_dir_through_a_broken_symlink_is_named_as_one(tmp_path: Path,
                                                            target: str) -> None:
    # Trial: `--out dangling` (a link to a directory not made yet, or to itself): "cannot
    # write the captures into --out dangling: File exists"
    (tmp_path / "loop").symlink_to(target)
    for out in (tmp_path / "loop", tmp_path / "loop" / "sub"):
        with pytest.raises(NondetError, match=r"is a symbolic link to .* does not exist or "
                                              r"leads back to itself"):
            outdir.check_root(out)


def test_a_huge_name_from_a_capture_is_clipped_in_the_text_report() -> None:
    # Trial: a module named "m" * 300_000: the module row and every context row (padded to
    # the longest module) printed 2.4 MB; the JSON report keeps the name whole
    huge = "m" * 300_000 + ".end"
    context = [ContextLine(index=i, op="aten.add_.Tensor", module=huge if i == 2 else "",
                           source="train.py:9", state="same", focus=i == 2) for i in range(4)]
    div = Divergence(kind="op", step=0, phase="backward", op="aten.index_put.default",
                     op_index=2, module=huge, source="train.py:9", context=context)
    report = Report(verdict="nondeterministic", exit_code=ExitCode.NONDETERMINISTIC,
                    runs=[], first_divergence=div)
    shown = text.lines(report)
    assert max(len(line) for line in shown) < 400
    assert any("…" in line and line.rstrip().endswith(".end") for line in shown)  # the end kept
    assert report.to_json()["first_divergence"]["module"] == huge


def test_a_deterministic_verdict_over_interrupted_runs_says_so() -> None:
    # Trial: `nondet diff` of the captures a SIGTERM left after 52,629 and 52,597 tiny
    # steps: "deterministic — 2 runs (52629, 52597 steps) are bitwise identical", as if to
    # the end
    runs = [RunSummary(path=f"run-{x}.h5", exit_code=143, steps=52_000 + i, complete=False,
                       status="interrupted", label=x) for i, x in enumerate("ab")]
    report = Report(verdict="deterministic", exit_code=ExitCode.DETERMINISTIC, runs=runs)
    assert "interrupted: a, b" in text.lines(report)[0]
    runs[1].status = "crashed"  # faults round 9: a run SIGKILLed mid-step, said nothing
    assert "interrupted: a; crashed: b" in text.lines(report)[0]
    runs[1].status = runs[0].status = "complete"
    assert "interrupted" not in text.lines(report)[0]  # the control


def test_a_diff_of_captures_interrupted_before_their_first_step_says_so(
        tmp_path: Path) -> None:
    # Faults round 9: both runs interrupted during init, then `nondet diff` of them: "no
    # training step was observed ... check that the script trains", which it does.
    rows = step_rows({"step": -1, "params_fp": 1})
    a = write_capture(tmp_path / "run-a.h5", rows, status="interrupted")
    b = write_capture(tmp_path / "run-b.h5", rows, status="interrupted")
    result = run_cli("diff", str(a), str(b), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "ended before the first step" in result.stderr, result.stderr
    assert "check that the script trains" not in result.stderr


def test_a_diff_of_a_runs_capture_and_a_childs_says_which_to_compare(tmp_path: Path) -> None:
    # Faults round 9: `nondet diff run-a.h5 run-b.child0.h5` said the two captures computed
    # fingerprints differently (a child capture records no scheme): two programs' steps.
    rows = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "params_fp": 2})
    a = write_capture(tmp_path / "run-a.h5", rows, attrs={"label": "a"})
    child = write_capture(tmp_path / "run-b.child0.h5", rows, attrs={"label": "b.child0"})
    result = run_cli("diff", str(a), str(child), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "run-a.child0.h5 with run-b.child0.h5" in result.stderr, result.stderr
    other = write_capture(tmp_path / "run-a.child0.h5", rows, attrs={"label": "a.child0"})
    assert run_cli("diff", str(other), str(child), cwd=tmp_path).returncode == 0
