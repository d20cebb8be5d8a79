"""nondet's threads in the script's process are out of its sight (own_threads.py)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli, tiny_training


def test_the_script_sees_only_its_own_threads(tmp_path: Path) -> None:
    """Faults round 13: ``threading.enumerate()`` listed nondet-fdwatch and nondet-orphan
    (a script asserting it started no thread failed under nondet only), and a script
    joining every other thread after training waited for them until the idle limit."""
    script = tmp_path / "train.py"
    script.write_text(
        "import threading, time\n"
        "def names():\n"
        "    return sorted(t.name for t in threading.enumerate())\n"
        "assert names() == ['MainThread'], names()\n"
        + tiny_training(6) +
        "    time.sleep(0.3)  # long enough for the channel's flusher to start\n"
        "assert names() == ['MainThread'] and threading.active_count() == 1, names()\n"
        "for t in threading.enumerate():\n"
        "    if t is not threading.main_thread():\n"
        "        t.join()\n")
    result = run_cli("run", "--no-verify", str(script), cwd=tmp_path, timeout=300,
                     env={"NONDET_IDLE_AFTER": "60"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "deterministic" in result.stdout, result.stdout
