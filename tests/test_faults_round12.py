"""Faults, twelfth round (FINDINGS.md), and the items left from the eleventh."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import REPO, run_cli

STEPS = str(REPO / "tests" / "data" / "scripts" / "steps.py")


def test_a_script_that_reads_a_line_of_input_is_told_its_stdin_is_empty(
        tmp_path: Path) -> None:
    """Left by faults round 11: a script asking for a value with ``input()`` failed with
    "EOFError: EOF when reading a line" and nothing said that nondet gives each run an
    empty stdin (the user had piped a value in)."""
    script = tmp_path / "train.py"
    script.write_text('lr = float(input("lr? "))\n')
    result = run_cli("run", str(script), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    error = next(line for line in result.stderr.splitlines() if line.startswith("nondet: error"))
    assert "EOFError" in error and "empty stdin" in error, error
    assert "Traceback" not in error


def test_other_failures_do_not_mention_stdin(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text('raise EOFError("end of my data file")\n')
    result = run_cli("run", str(script), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "stdin" not in result.stderr, result.stderr


def test_update_baseline_through_a_symbolic_link_renews_its_target(tmp_path: Path) -> None:
    """Left by faults round 11: a baseline kept in one place and linked from the project
    was replaced by a file on ``--update-baseline``; the link stays, its target is renewed."""
    from nondet import baseline

    capture = tmp_path / "run.h5"
    capture.write_bytes(b"new capture bytes")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "base.h5").write_bytes(b"old")
    link = tmp_path / "base.h5"
    link.symlink_to(shared / "base.h5")
    size = baseline.save(capture, link)
    assert link.is_symlink() and os.readlink(link) == str(shared / "base.h5")
    assert (shared / "base.h5").read_bytes() == b"new capture bytes" and size == 17
    assert sorted(p.name for p in shared.iterdir()) == ["base.h5"]  # no temporary left


def test_a_check_with_another_seed_than_its_baseline_says_so(tmp_path: Path) -> None:
    """Left by faults round 11: ``--seed 1`` against a baseline written with the default
    seed was refused as environment drift in ``PYTHONHASHSEED`` (or, allowed, a FAIL at
    step 0): the seeds differ, and the line says which to pass."""
    stored = tmp_path / "base.h5"
    written = run_cli("check", "--update-baseline", "--baseline", str(stored), STEPS,
                      "--steps", "3", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    result = run_cli("check", "--seed", "1", "--baseline", str(stored), STEPS, "--steps", "3",
                     cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "written with --seed 0" in line and "runs with --seed 1" in line, line
    assert "PYTHONHASHSEED" not in result.stderr


def test_an_exception_groups_failure_is_named_by_the_group_and_its_first_exception(
        ) -> None:
    """Left by faults round 11: a script ending in an ``ExceptionGroup`` was reported as
    "the script failed ...: +------------------------------------" (the box's last line)."""
    import subprocess
    import sys

    from nondet.schedule import exception_line

    source = ("def f():\n    raise ValueError('a')\n"
              "try:\n    f()\nexcept ValueError as e:\n    first = e\n"
              "raise ExceptionGroup('many', [first, ExceptionGroup('inner', [KeyError('c')])])\n")
    traceback = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                               timeout=60).stderr
    assert exception_line(traceback) == \
        "ExceptionGroup: many (2 sub-exceptions) (the first: ValueError: a)", traceback


ECHO_OFF = """import termios
with open("/dev/tty") as tty:  # as getpass does, and one run of two restored it too late
    attrs = termios.tcgetattr(tty)
    attrs[3] &= ~termios.ECHO
    termios.tcsetattr(tty, termios.TCSANOW, attrs)
"""


def test_the_terminal_is_left_as_nondet_found_it(tmp_path: Path) -> None:
    """Faults round 12: both runs prompting with getpass on nondet's terminal left the
    user's shell with echo off after nondet exited (plain python restores it)."""
    import pty
    import select
    import sys
    import termios
    import time

    from tests.conftest import tiny_training

    script = tmp_path / "train.py"
    script.write_text(ECHO_OFF + tiny_training())
    pid, master = pty.fork()
    if pid == 0:  # the child: nondet on the pty as its controlling terminal
        os.chdir(tmp_path)
        os.execv(sys.executable, [sys.executable, "-m", "nondet", "run", "-q",
                                  "--no-verify", str(script)])
    output, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed the pty
                break
            if not chunk:
                break
            output += chunk
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            break
    else:
        os.kill(pid, 9)
        raise AssertionError(f"nondet still runs after 300 s: {output!r}")
    if not finished:
        _, status = os.waitpid(pid, 0)
    echo = termios.tcgetattr(master)[3] & termios.ECHO
    os.close(master)
    assert os.waitstatus_to_exitcode(status) == 0, output
    assert echo, output  # the terminal echoes again, as before nondet ran


SYSTEM_RANDOM = """import random
import torch

augment = random.SystemRandom()  # line 4: the OS's entropy
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 8)
for step in range(4):
    idx = torch.tensor(augment.sample(range(64), 16))
    loss = model(x[idx]).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_system_random_is_its_own_cause_and_its_fix_is_verified(tmp_path: Path) -> None:
    """PyTorch round 15: ``random.SystemRandom()`` in a collate_fn got PY-ENTROPY, whose
    seeding patch "did not help" (SystemRandom ignores seeds), and its site read
    "random.Random()/random.seed() without a seed"."""
    import json

    script = tmp_path / "train.py"
    script.write_text(SYSTEM_RANDOM)
    result = run_cli("run", "-q", "--json", "r.json", str(script), cwd=tmp_path, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    first = json.loads((tmp_path / "r.json").read_text())["suggestions"][0]
    assert first["id"] == "PY-SYSTEM-RANDOM", first
    assert first["verified"] is True, first
    assert "random.SystemRandom() at train.py:4" in first["details"], first


def test_a_loss_difference_fits_its_column_in_the_growth_table() -> None:
    """Faults round 12: |Δ loss| values like 0.00146484375 were printed with 9 significant
    digits and pushed the bar column out of line."""
    from nondet.report.text import _num

    assert _num(0.00146484375, 4) == "0.001465" and len(_num(9999.87654321, 4)) <= 11
    assert _num(0.00146484375) == "0.00146484375"  # losses keep every digit they have


def test_runs_has_an_upper_bound(tmp_path: Path) -> None:
    """Faults round 12: ``--runs 1000000`` was accepted and started a million runs."""
    (tmp_path / "train.py").write_text("pass\n")
    result = run_cli("run", "--runs", "1000000", "train.py", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "--runs" in result.stderr, result.stderr
    assert not (tmp_path / ".nondet").exists()
