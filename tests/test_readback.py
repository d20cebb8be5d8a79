"""readback: a run that reads a file an earlier run of the same invocation wrote is noted.

The hooks replace ``builtins.open`` and ``os.open``, so each case runs in a fresh Python
process with a stand-in session that prints the facts it is sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from nondet import readback
from tests.conftest import step_rows, write_capture

_HARNESS = textwrap.dedent("""
    import json, os, pickle, sys, time
    from nondet import readback, session as session_module

    class Sent:
        facts = {}
        def send_facts(self, facts):
            self.facts.update(facts)

    sent = Sent()
    session_module._CURRENT = sent
    readback.install(sent, run_started=float(sys.argv[1]))
    exec(sys.argv[2])
    print(json.dumps(sent.facts))
""")


def _run(cwd: Path, code: str, run_started: float, invocation: float) -> dict[str, str]:
    env = {**os.environ, readback.STARTED_ENV: str(invocation),
           "PYTHONPATH": str(Path(readback.__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-c", _HARNESS, str(run_started), code], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    facts: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
    return facts


def _written(path: Path, at: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x80\x04K\x01.")  # pickle of 1
    os.utime(path, (at, at))


def test_a_file_an_earlier_run_wrote_is_noted_once(tmp_path: Path) -> None:
    now = time.time()
    _written(tmp_path / "checkpoints" / "last.pkl", now - 5)
    code = ("pickle.load(open('checkpoints/last.pkl', 'rb'))\n"
            "os.close(os.open('checkpoints/last.pkl', os.O_RDONLY))")
    facts = _run(tmp_path, code, run_started=now, invocation=now - 20)
    key = f"capture_note.{readback.FACT}:{os.path.join('checkpoints', 'last.pkl')}"
    assert list(facts) == [key]
    assert "checkpoints/last.pkl" in facts[key] and "delete it" in facts[key]


def test_os_open_for_reading_is_seen(tmp_path: Path) -> None:
    now = time.time()
    _written(tmp_path / "cache.bin", now - 5)
    facts = _run(tmp_path, "os.close(os.open('cache.bin', os.O_RDONLY))",
                 run_started=now, invocation=now - 20)
    assert list(facts) == [f"capture_note.{readback.FACT}:cache.bin"]


def test_data_older_than_the_invocation_and_own_writes_stay_quiet(tmp_path: Path) -> None:
    now = time.time()
    _written(tmp_path / "data.pkl", now - 3600)  # the script's input, there before nondet
    _written(tmp_path / "old_ckpt.pkl", now - 5)  # written by another run, but only rewritten
    _written(tmp_path / ".nondet" / "x" / "run-a.h5", now - 5)  # nondet's own output
    code = ("pickle.load(open('data.pkl', 'rb'))\n"
            "open('old_ckpt.pkl', 'wb').close()\n"
            "open('.nondet/x/run-a.h5', 'rb').close()\n"
            "with open('mine.log', 'w') as f: f.write('x')\n"
            "open('mine.log').read()\n"  # written by this run itself: newer than its start
            "os.close(os.open('fd.bin', os.O_WRONLY | os.O_CREAT))")
    assert _run(tmp_path, code, run_started=now, invocation=now - 20) == {}


def test_the_scripts_own_errors_stay_its_own(tmp_path: Path) -> None:
    now = time.time()
    code = ("try:\n    open('missing.pt', 'rb')\nexcept FileNotFoundError as e:\n"
            "    assert e.filename == 'missing.pt'; sent.facts['raised'] = 'yes'")
    assert _run(tmp_path, code, run_started=now, invocation=now - 20) == {"raised": "yes"}


def test_without_the_invocation_time_nothing_is_watched(tmp_path: Path) -> None:
    import builtins

    env = {k: v for k, v in os.environ.items() if k != readback.STARTED_ENV}
    code = ("import builtins, os; from nondet import readback;"
            "before = builtins.open; readback.install(object());"
            "print(builtins.open is before)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={
        **env, "PYTHONPATH": str(Path(readback.__file__).parent.parent)},
        capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True"
    assert builtins.open is open  # this process was never patched


def test_report_notes_name_the_file_once_and_doubt_a_verified_fix(tmp_path: Path) -> None:
    fact = {f"capture_note.{readback.FACT}:ckpt.pt": readback.note_text("ckpt.pt")}
    steps = step_rows({"step": 0})
    dump = [str(write_capture(tmp_path / f"run-{x}-dump.h5", steps, facts=fact)) for x in "ab"]
    fixed = str(write_capture(tmp_path / "run-a-fix1.h5", steps, facts=fact))
    quiet = str(write_capture(tmp_path / "run-b-fix1.h5", steps, facts={"framework": "torch"}))
    assert readback.report_notes(dump) == [readback.note_text("ckpt.pt")]
    notes = readback.report_notes([*dump, fixed, quiet, "run-a.log"])
    assert notes[0] == readback.note_text("ckpt.pt") and len(notes) == 2
    assert "verified" in notes[1]
    assert readback.report_notes([quiet]) == []
