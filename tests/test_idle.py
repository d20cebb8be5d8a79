"""A run that goes idle (no frames, no CPU) is ended, never waited for forever
(``nondet.idle``): the watch itself, then a script that sleeps after training through the
real CLI in both schedules."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from nondet.idle import IdleWatch, tree_cpu_seconds, tree_runnable
from tests.conftest import run_cli, tiny_training

BOUND = 240  # seconds; the CLI cases take ~30 s on a loaded 2-core machine


def test_cpu_of_a_process_tree_counts_its_children() -> None:
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass\n"
    # the parent sleeps while its child computes: the tree is busy
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {busy!r}])
        """)])
    try:
        deadline = time.monotonic() + 60
        used = 0.0
        while time.monotonic() < deadline and parent.poll() is None:
            used = max(used, tree_cpu_seconds(parent.pid) or 0.0)
            time.sleep(0.2)
        assert used >= 1.0
    finally:
        parent.kill()
        parent.wait(10)
    assert tree_cpu_seconds(parent.pid) is None  # gone: cannot tell


def _NEVER_RUNNABLE(pid: int) -> bool:
    return False


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("cpu_per_second,idle", [(0.0, True), (0.5, False)])
def test_idle_only_without_frames_and_without_cpu(cpu_per_second: float, idle: bool) -> None:
    clock = _Clock()
    watch = IdleWatch(1, after=60.0, cpu=lambda pid: cpu_per_second * clock.now, clock=clock,
                      runnable=_NEVER_RUNNABLE)
    seen = []
    for _ in range(30):  # 150 s, sampled every 5 s
        clock.now += 5.0
        seen.append(watch.idle())
    assert seen[-1] is idle
    assert not any(seen[:11])  # never before the limit


def test_a_frame_starts_a_new_window() -> None:
    clock = _Clock()
    watch = IdleWatch(1, after=60.0, cpu=lambda pid: 0.0, clock=clock,
                      runnable=_NEVER_RUNNABLE)
    for _ in range(30):
        clock.now += 5.0
        if clock.now % 50 == 0:
            watch.activity()
        assert not watch.idle()


def test_unknown_cpu_is_never_idle() -> None:
    clock = _Clock()
    watch = IdleWatch(1, after=10.0, cpu=lambda pid: None, clock=clock,
                      runnable=_NEVER_RUNNABLE)
    for _ in range(20):
        clock.now += 5.0
        assert not watch.idle()


def test_a_tree_waiting_for_a_cpu_is_never_idle() -> None:
    # At load 14 a run under `nice` got under 2% of a core for NONDET_IDLE_AFTER=4 s and was
    # ended as idle before its first step ("no training step was observed").
    clock = _Clock()
    watch = IdleWatch(1, after=10.0, cpu=lambda pid: 0.0, clock=clock,
                      runnable=lambda pid: True)
    for _ in range(20):
        clock.now += 5.0
        assert not watch.idle()


def test_a_computing_process_is_runnable_and_a_sleeping_one_is_not() -> None:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    nap = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while not tree_runnable(spin.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # sampled: on a loaded machine it may be between its turns
        assert tree_runnable(spin.pid)
        while tree_runnable(nap.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # still starting up
        assert not tree_runnable(nap.pid)
    finally:
        for process in (spin, nap):
            process.kill()
            process.wait(10)


SLEEPS_AFTER_TRAINING = "import time\n" + tiny_training() + """
print("trained; serving forever", flush=True)
while True:
    time.sleep(1000)
"""


@pytest.mark.parametrize("schedule", [[], ["--schedule", "sequential"], ["--runs", "3"]],
                         ids=["lockstep", "sequential", "runs"])
def test_a_script_that_sleeps_after_training_is_compared_not_waited_for(
        tmp_path: Path, schedule: list[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(SLEEPS_AFTER_TRAINING)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", *schedule, str(script),
                     cwd=tmp_path, env={"NONDET_IDLE_AFTER": "4"}, timeout=BOUND)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    count = 3 if "--runs" in schedule else 2
    assert [(r["steps"], r["status"]) for r in report["runs"]] == [(4, "stopped")] * count
    assert sum("nondet ended it" in note for note in report["notes"]) == count, report["notes"]
    out = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert out.stdout.strip() == ""  # no run left sleeping


HANGS_IN_ONE_RUN = """
import os, sys, time, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:  # the first run to get here hangs after step 1 (a deadlock that strikes once)
    os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL))
    hangs = True
except FileExistsError:
    hangs = False
for step in range(4):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    while hangs and step == 1:
        time.sleep(1000)
"""


def _run_once_marked(tmp_path: Path, source: str, schedule: list[str],
                     expect: int) -> dict[str, Any]:
    """``nondet run`` of a script whose first run to get somewhere leaves a mark (its first
    argument) that the others find; the JSON report, once it exited ``expect``."""
    script = tmp_path / "train.py"
    script.write_text(source)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", *schedule, str(script),
                     str(tmp_path / "first.mark"), cwd=tmp_path,
                     env={"NONDET_IDLE_AFTER": "4"}, timeout=BOUND)
    assert result.returncode == expect, result.stdout + result.stderr
    report: dict[str, Any] = json.loads((tmp_path / "r.json").read_text())
    return report


@pytest.mark.parametrize("schedule", [[], ["--schedule", "sequential"]],
                         ids=["lockstep", "sequential"])
def test_a_run_that_hangs_mid_training_while_its_twin_trains_on_is_a_finding(
        tmp_path: Path, schedule: list[str]) -> None:
    """It was ended as idle and its 2 steps compared with the twin's first 2: "deterministic",
    exit 0, for a script that hangs in one run in two."""
    report = _run_once_marked(tmp_path, HANGS_IN_ONE_RUN, schedule, expect=1)
    shorter, longer = sorted(r["steps"] for r in report["runs"])
    assert shorter == 2 and longer > 2  # (lockstep stops the twin soon after: 3 or 4)
    assert report["first_divergence"]["step"] == 2
    assert any("nondet ended it" in note for note in report["notes"]), report["notes"]


WAITS_FOR_ITS_CHILD_AT_EXIT = """
import multiprocessing as mp, os, sys, time, torch

def sleeper():
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           f"child-{os.getpid()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1000)

if __name__ == "__main__":
    mp.Process(target=sleeper, args=()).start()  # not a daemon: exit waits for it
""" + textwrap.indent(tiny_training(3), "    ")


def test_a_script_waiting_at_exit_for_its_child_is_ended_with_it(tmp_path: Path) -> None:
    """Trial: the script ended (its END sent) and then waited at exit for a
    multiprocessing child that never ends: nondet waited 120 s per run, then ended the
    script alone, its child left running (parent 1) after nondet exited."""
    script = tmp_path / "train.py"
    script.write_text(WAITS_FOR_ITS_CHILD_AT_EXIT)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script),
                     cwd=tmp_path, env={"NONDET_IDLE_AFTER": "4"}, timeout=BOUND)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    # Python's wait at exit (multiprocessing's atexit joins the child) runs before the run
    # ends (boot._python_shutdown), so the run is ended as idle there: stopped, with a note
    assert [(r["steps"], r["status"]) for r in report["runs"]] == [(3, "stopped")] * 2
    assert sum("nondet ended it" in note for note in report["notes"]) == 2, report["notes"]
    children = [int(p.read_text()) for p in tmp_path.glob("child-*.pid")]
    assert len(children) == 2
    assert not [pid for pid in children if _alive(pid)], children  # none left behind


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[:1] != [b"Z"]
    except OSError:
        return False


def _quiet_watch(pid: int, clock: _Clock) -> IdleWatch:
    """A watch of a run that never uses CPU, on the test's clock."""
    return IdleWatch(pid, after=600.0, cpu=lambda pid: 0.0, clock=clock,
                     runnable=_NEVER_RUNNABLE)


def test_a_run_outlives_its_ended_twin_after_five_of_its_longest_quiet_spells() -> None:
    clock = _Clock()
    twin, run = _quiet_watch(1, clock), _quiet_watch(2, clock)
    clock.now += 30.0
    twin.activity(counts=False)  # start-up: a frame before its first step row
    for quiet in (1.0, 20.0, 1.0):  # steps, then its end
        clock.now += quiet
        twin.activity()
    run.activity()  # this run's last step, at the twin's end
    assert twin.longest_quiet == 20.0
    clock.now += 99.0
    assert run.outlived(twin, floor=60.0) == 0.0  # within 5 x 20 s
    clock.now += 2.0
    assert run.outlived(twin, floor=60.0) == 101.0
    assert run.outlived(twin, floor=200.0) == 0.0  # never before the floor
    run.activity()  # a frame: it is doing something again
    assert run.outlived(twin, floor=60.0) == 0.0


def test_a_run_that_outlives_its_twin_counts_from_the_twins_end() -> None:
    clock = _Clock()
    twin, run = _quiet_watch(1, clock), _quiet_watch(2, clock)
    clock.now += 1.0
    run.activity()  # its last frame long before the twin ended (lockstep freed both)
    clock.now += 500.0
    twin.activity()
    clock.now += 59.0
    assert run.outlived(twin, floor=60.0) == 0.0


SPINS_IN_ONE_RUN = "import os, sys\n" + tiny_training() + """
try:  # the first run to get here ends; the second spins for good (a stuck evaluation)
    os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL))
except FileExistsError:
    while True:
        pass
"""


@pytest.mark.parametrize("schedule", [[], ["--schedule", "sequential"], ["--runs", "3"]],
                         ids=["lockstep", "sequential", "runs"])
def test_a_run_that_computes_for_good_after_its_twin_ended_is_ended(
        tmp_path: Path, schedule: list[str]) -> None:
    """Trial: nondet waited for good (until `timeout`'s SIGTERM) for a run that looped
    forever after training while the other had ended: such a run is never idle (it uses
    CPU), and nothing else ended it."""
    report = _run_once_marked(tmp_path, SPINS_IN_ONE_RUN, schedule, expect=0)
    spun = 2 if "--runs" in schedule else 1  # every run after the first spins
    assert sorted((r["steps"], r["status"]) for r in report["runs"]) == [
        (4, "complete"), *[(4, "stopped")] * spun]
    if "--runs" not in schedule:  # (--runs reports its table of outcomes instead)
        assert any("after the other run had ended" in note for note in report["notes"]), \
            report["notes"]
    out = subprocess.run(["pgrep", "-f", str(tmp_path / "train.py")], capture_output=True,
                         text=True)
    assert out.stdout.strip() == ""  # the spinning run was ended


def test_a_run_still_starting_up_is_measured_by_its_twins_start_up() -> None:
    """Review: in the sequential schedule the second run's start-up (90 s of data
    preparation) counted against the first run's longest quiet spell between steps (short),
    so a healthy run was ended after the floor, before its first step."""
    clock = _Clock()
    twin = _quiet_watch(1, clock)
    clock.now += 90.0
    twin.activity(counts=False)
    twin.stepped()  # its first step row after 90 s of start-up
    for _ in range(3):
        clock.now += 0.5
        twin.activity()
    clock.now += 1.0
    twin.activity()  # its end
    run = _quiet_watch(2, clock)
    clock.now += 120.0
    assert run.outlived(twin, floor=60.0) == 0.0  # within 5 x the twin's 90 s start-up
    clock.now += 400.0
    assert run.outlived(twin, floor=60.0) == 520.0


def test_a_run_held_for_its_turn_is_not_quiet_while_it_waits() -> None:
    """Trial: in lockstep the ended run had waited 60 s for its turn while its twin looped
    after training (until the stall rule freed it): that wait counted as its longest quiet
    spell, and the looping twin was ended only after 5 x 60 s."""
    clock = _Clock()
    twin, run = _quiet_watch(1, clock), _quiet_watch(2, clock)
    clock.now += 10.0
    twin.activity(counts=False)
    clock.now += 1.0
    twin.activity()  # its last step: it waits for its turn now
    run.activity()
    clock.now += 60.0
    twin.word()  # freed
    clock.now += 1.0
    twin.activity()  # its end, a second later
    assert twin.longest_quiet == 1.0
    clock.now += 61.0
    assert run.outlived(twin, floor=60.0) > 0


def test_an_idle_limit_that_ends_the_runs_before_their_first_step_is_named(
        tmp_path: Path) -> None:
    """A limit set lower than the script's wait before training: the runs were ended, not
    stepless ("no training step was observed ... check that the script trains", before)."""
    script = tmp_path / "train.py"
    script.write_text("import time\nimport torch\ntime.sleep(60)\n" + tiny_training(steps=3))
    result = run_cli("run", "-q", "--no-verify", str(script), cwd=tmp_path,
                     env={"NONDET_IDLE_AFTER": "2"}, timeout=BOUND)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "raise NONDET_IDLE_AFTER" in lines[0], result.stderr
    assert "before its first step ended" in lines[0]
