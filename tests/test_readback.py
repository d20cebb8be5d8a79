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
from typing import Any

import pytest

from nondet import readback
from nondet.store import open_capture
from tests.conftest import run_cli, step_rows, write_capture

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


def _run(cwd: Path, code: str, run_started: float, invocation: float) -> dict[str, Any]:
    env = {**os.environ, readback.STARTED_ENV: str(invocation),
           "PYTHONPATH": str(Path(readback.__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-c", _HARNESS, str(run_started), code], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
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
    facts = _run(tmp_path, code, run_started=now, invocation=now - 20)
    # no note, and nothing read that another wrote; the writes are listed for pair_notes
    assert facts == {readback.WROTE_FACT: ["old_ckpt.pkl", "mine.log", "fd.bin"]}, facts


def test_a_file_saved_just_before_the_invocation_is_no_runs_output(tmp_path: Path) -> None:
    """A script (or its data) written a moment before `nondet run` started: the mtime has
    sub-second precision, so the one-second slack for coarse file systems does not apply
    (round 7: FSDP2's script, saved and run at once, was "written by an earlier run")."""
    now = time.time()
    _written(tmp_path / "train.py", now - 20.3)
    _written(tmp_path / "coarse.pkl", float(int(now - 20)))  # whole seconds: still counts
    code = "open('train.py', 'rb').read()\npickle.load(open('coarse.pkl', 'rb'))"
    facts = _run(tmp_path, code, run_started=now, invocation=now - 20)
    assert list(facts) == [f"capture_note.{readback.FACT}:coarse.pkl"], facts


def test_a_file_written_by_another_while_the_run_went_is_listed(tmp_path: Path) -> None:
    now = time.time()
    _written(tmp_path / "features.pkl", now + 2)  # the twin wrote it after this run started
    code = ("pickle.load(open('features.pkl', 'rb'))\n"
            "with open('own.pkl', 'wb') as f: pickle.dump(1, f)\n"
            "pickle.load(open('own.pkl', 'rb'))\n"  # its own: never "fresh"
            "os.makedirs('ckpt-1')\n"
            "os.close(os.open('ckpt-1', os.O_RDONLY))")  # a directory listed (rmtree)
    facts = _run(tmp_path, code, run_started=now, invocation=now - 20)
    assert facts == {readback.FRESH_FACT: ["features.pkl"], readback.WROTE_FACT: ["own.pkl"]}


def _pair_notes(tmp_path: Path, facts_a: dict[str, Any], facts_b: dict[str, Any]
                ) -> list[str]:
    """``readback.pair_notes`` of two one-step captures with these facts."""
    steps = step_rows({"step": 0})
    a = write_capture(tmp_path / "run-a.h5", steps, facts=facts_a, attrs={"label": "a"})
    b = write_capture(tmp_path / "run-b.h5", steps, facts=facts_b, attrs={"label": "b"})
    return readback.pair_notes(open_capture(a), open_capture(b))


def test_pair_notes_name_a_file_one_run_read_and_the_other_wrote(tmp_path: Path) -> None:
    def pair(fresh_a: list[str], wrote_b: list[str]) -> list[str]:
        return _pair_notes(tmp_path, {readback.FRESH_FACT: fresh_a},
                           {readback.WROTE_FACT: wrote_b})

    notes = pair(["cache/features.npy"], ["log.txt", "cache/features.npy"])
    assert len(notes) == 1 and notes[0].startswith(
        "run a read cache/features.npy, which run b wrote while both ran"), notes
    # a file the other run did not open for writing (its own torch.save in C, say): quiet
    assert pair(["ckpt.pt"], ["log.txt"]) == []
    assert pair([], ["ckpt.pt"]) == []


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


_CACHE_IF_MISSING = """
import os
import numpy as np
import torch
torch.manual_seed(0)
if not os.path.exists("features.npy"):
    feats = np.random.default_rng().normal(size=(64, 8)).astype(np.float32)  # unseeded
    np.save("features.npy", feats)
else:
    feats = np.load("features.npy")
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.from_numpy(feats)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.e2e
def test_a_cache_one_run_of_the_pair_builds_and_the_other_reads_is_named(
        tmp_path: Path) -> None:
    """The pair's race: whichever run gets there first builds the cache (from an unseeded
    generator), the other loads it, and both train on the same data. The verdict cannot
    show the cause; the note names the file (nothing was said before)."""
    (tmp_path / "train.py").write_text(_CACHE_IF_MISSING)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", "train.py",
                     cwd=tmp_path, timeout=240)
    report = json.loads((tmp_path / "r.json").read_text())
    race = [n for n in report["notes"] if "features.npy, which run" in n]
    if report["verdict"] == "nondeterministic":
        # both runs found no cache and built their own (they checked within microseconds
        # of each other): then the differing data is found and nothing was read back
        assert not race, report["notes"]
        return
    assert len(race) == 1 and "wrote while both ran" in race[0], (result.stdout, report)


def test_installed_packages_inside_the_project_are_not_the_scripts_state(
        tmp_path: Path) -> None:
    # Trial: `make demo` (pip install -e into the project's .venv, then `nondet run` within
    # the second): "a run read .venv/lib/python3.11/site-packages/nondet-0.1.0.dist-info/
    # entry_points.txt, written by an earlier run of this nondet invocation"
    now = time.time()
    meta = tmp_path / "env" / "lib" / "site-packages" / "pkg-1.0.dist-info" / "entry_points.txt"
    _written(meta, now - 5)
    _written(tmp_path / "cache.bin", now - 5)
    code = f"open('cache.bin', 'rb').read(); open({str(meta)!r}, 'rb').read()"
    facts = _run(tmp_path, code, run_started=now, invocation=now - 20)
    assert list(facts) == [f"capture_note.{readback.FACT}:cache.bin"]


def test_files_frameworks_read_in_c_are_checked_like_opens(tmp_path: Path) -> None:
    """h-realtf round 7: a TensorFlow checkpoint restored, a Keras .weights.h5 loaded and a
    tf.data cache found are read in C, never through ``open``: the later runs (narrowing,
    verification) resumed from the first pair's files with nothing said. The framework
    hooks (``frameworks.tensorflow.file_reads``) report them here."""
    now = time.time()
    _written(tmp_path / "mgr" / "ckpt-2.index", now - 5)  # an earlier run's checkpoint
    _written(tmp_path / "ck.weights.h5", now - 3600)  # the script's input, older: quiet
    _written(tmp_path / "old.index", now - 3600)  # a cache there before nondet: quiet
    _written(tmp_path / "twin.index", now + 2)  # a cache the twin finished while this ran
    code = ("readback.file_read('mgr/ckpt-2.index')\n"
            "readback.file_read('ck.weights.h5')\n"
            "readback.cache_file('old')\n"
            "readback.cache_file('twin')\n"
            "readback.cache_file('missing')\n"  # not there yet: this run or the twin builds it
            "readback.cache_file('missing')\n"
            # BackupAndRestore's rmtree of an earlier run's directory: a listing, no read
            "os.close(os.open('backup', os.O_RDONLY))\n")
    (tmp_path / "backup").mkdir()
    os.utime(tmp_path / "backup", (now - 5, now - 5))
    facts = _run(tmp_path, code, run_started=now, invocation=now - 20)
    ckpt = os.path.join("mgr", "ckpt-2.index")
    assert facts.pop(f"capture_note.{readback.FACT}:{ckpt}") == readback.note_text(ckpt)
    assert facts == {readback.CACHE_FACT: ["twin", "missing"],
                     readback.FRESH_FACT: ["twin.index"]}


def test_pair_notes_name_a_tf_data_cache_both_runs_meant_to_build(tmp_path: Path) -> None:
    """Both runs of the pair found no cache file: TensorFlow reads a finished cache and
    refuses a second writer, so one run trained on what the other cached (rn_cache in
    FINDINGS round 7: an unseeded generator before the cache, "deterministic", no note)."""
    def pair(a: list[str], b: list[str]) -> list[str]:
        return _pair_notes(tmp_path, {readback.CACHE_FACT: a}, {readback.CACHE_FACT: b})

    notes = pair(["cache/train"], ["cache/val", "cache/train"])
    assert len(notes) == 1 and notes[0].startswith(
        "runs a and b both cached a tf.data pipeline to cache/train"), notes
    assert pair(["cache/train"], []) == []


RESUMES = """
import os, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if os.path.exists("ckpt.pt"):  # resumes from what an earlier run left
    with open("ckpt.pt", "rb") as f:
        model.load_state_dict(torch.load(f))
for step in range(3):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
with open("ckpt.pt", "wb") as f:
    torch.save(model.state_dict(), f)
"""


def test_runs_that_part_because_one_resumed_from_the_others_file_are_not_compared(
        tmp_path: Path) -> None:
    """Trials: one run after the other (``--schedule sequential``), run b resumed from the
    checkpoint run a saved: "nondeterministic", exit 1, with an RNG cause and the fix
    ``torch.manual_seed(seed)`` the script already had; the file was only a note."""
    script = tmp_path / "train.py"
    script.write_text(RESUMES)
    result = run_cli("run", "-q", "--no-verify", "--schedule", "sequential", str(script),
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "run b read ckpt.pt, which run a of this nondet invocation wrote" in result.stderr
    assert "nondeterministic" not in result.stdout


CACHED_THEN_RACES = """
import os, torch
torch.manual_seed(0)
if os.path.exists("tokens.pt"):  # a cache built from a seed, reused when present
    with open("tokens.pt", "rb") as f:
        tokens = torch.load(f)
else:
    tokens = torch.randint(0, 10, (4, 200_000), generator=torch.Generator().manual_seed(1))
    with open("tokens.pt", "wb") as f:
        torch.save(tokens, f)
table = torch.nn.Parameter(torch.randn(10, 4))
opt = torch.optim.SGD([table], lr=0.01)
for step in range(4):  # the backward of table[tokens] adds in parallel: a race on CPU
    loss = (table[tokens[step]] * torch.randn(200_000, 4)).sum() / 200_000
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_cache_one_run_built_and_the_other_read_points_to_lockstep(tmp_path: Path) -> None:
    """Trial: one run after the other, run b loaded the token cache run a built, so the runs
    ran other code at their start (build against load) and that came first, before the
    race; exit 2 says so and names the default lockstep schedule, where both runs start
    before either writes the cache and the race is the finding."""
    script = tmp_path / "train.py"
    script.write_text(CACHED_THEN_RACES)
    result = run_cli("run", "-q", "--no-verify", "--schedule", "sequential", str(script),
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "run b read tokens.pt" in result.stderr and "lockstep" in result.stderr
    (tmp_path / "tokens.pt").unlink()  # as the message says
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script),
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_divergence"]["op"] == "aten.index_put.default"
