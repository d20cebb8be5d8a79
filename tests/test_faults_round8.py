"""Faults, eighth round (FINDINGS.md): what the script sees of nondet's own set-up, a
script that replaces a library function nondet uses, and a FIFO as a report path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from nondet import procstat
from tests.conftest import run_cli, tiny_training


def test_a_seed_from_the_environment_is_no_false_alarm(tmp_path: Path) -> None:
    """Each run's environment held nondet's config for it (the label, descriptor numbers):
    a script seeding from a checksum of ``os.environ`` (plain runs identical) got exit 1,
    "torch.manual_seed received a different seed", with a "verified" fix."""
    script = tmp_path / "train.py"
    script.write_text("import os, zlib\n" + tiny_training().replace(
        "torch.manual_seed(0)",
        "torch.manual_seed(zlib.crc32(repr(sorted(os.environ.items())).encode()))"))
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), str(script),
                   cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_script_replacing_json_dumps_is_not_blamed(tmp_path: Path) -> None:
    """A script's own JSON policy made nondet's frames fail, and that error surfaced at the
    script's ``torch.manual_seed``: exit 2, "the script failed" (plain python: exit 0)."""
    script = tmp_path / "train.py"
    script.write_text("import json\n"
                      "def strict(*args, **kwargs):\n"
                      "    raise TypeError('json.dumps is not allowed here')\n"
                      "json.dumps = strict\n" + tiny_training())
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), str(script),
                   cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_fifo_nobody_reads_is_refused_and_one_read_gets_the_report(tmp_path: Path) -> None:
    """Opening a FIFO to write waits for a reader: ``--json fifo`` with none hung for ever
    (after the runs, in ``nondet run``; at once in ``diff``)."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training())
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    done = run_cli("run", "-q", "--no-verify", "--json", str(fifo), "--out",
                   str(tmp_path / "out"), str(script), cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no program reads it" in done.stderr and "Traceback" not in done.stderr

    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    done = run_cli("run", "-q", "--no-verify", "--json", str(fifo), "--out",
                   str(tmp_path / "out"), str(script), cwd=tmp_path, timeout=300)
    reader.join(timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert got and b'"nondet_report_version"' in got[0]


def test_runs_end_when_nondet_is_killed_between_their_steps(tmp_path: Path) -> None:
    """SIGKILL to nondet (the OOM killer, a CI hard timeout): a run that never reaches its
    next step boundary never found the pipe closed, and kept running under init (a trial
    killed one 12 minutes later)."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training(100) + "    if step == 2:  # waits between steps (a server)\n"
                      "        open(f'looping-{__import__(\"os\").getpid()}', 'w').close()\n"
                      "        while True:\n"
                      "            __import__('time').sleep(0.2)\n")
    nondet = subprocess.Popen([sys.executable, "-m", "nondet", "run", "-q", "--out",
                               str(tmp_path / "out"), str(script)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(tmp_path.glob("looping-*")):
        time.sleep(0.5)
        stats = procstat.stat_fields() or {}
        runs = [pid for pid, fields in stats.items() if fields[1] == str(nondet.pid)
                and "nondet.boot" in _cmdline(pid)]
    looping = [int(p.name.split("-")[1]) for p in tmp_path.glob("looping-*")]
    assert looping and set(looping) <= set(runs), "no run reached its wait"
    nondet.kill()
    nondet.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in runs):
        time.sleep(0.5)
    left = [pid for pid in runs if _alive(pid)]
    for pid in left:  # never leave them behind, whatever the verdict
        os.kill(pid, signal.SIGKILL)
    assert not left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_one_path_for_two_reports_or_a_dash_is_refused_before_the_runs(tmp_path: Path) -> None:
    """``--json r --html r`` wrote the HTML over the JSON without a word; ``--json -`` made a
    file named ``-``."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training())
    same = run_cli("run", "--json", "r.out", "--html", "r.out", str(script), cwd=tmp_path)
    assert same.returncode == 2 and "name the same file" in same.stderr, same.stderr
    dash = run_cli("check", "--json", "-", str(script), cwd=tmp_path)
    assert dash.returncode == 2 and "give a file path" in dash.stderr, dash.stderr
    assert not (tmp_path / "-").exists()
    assert '"verdict": "error"' in (tmp_path / "r.out").read_text()  # the error, as asked
