"""A script that fails in one run of a lockstep pair only, having written files into the
working directory both runs share: the error says the runs ran side by side there
(``run_collisions.side_by_side_hint``), since a run may have read what the other was
writing. Trial: a Keras script that rewrote its TFRecord shards at every start failed in 3
of 7 invocations with "corrupted record", reported as the script's own failure."""

from __future__ import annotations

import os
import time
from pathlib import Path

from nondet import outdir, run_collisions
from tests.conftest import run_cli, tiny_training

BOUND = 300

# Writes its shard at every start; then (the race made certain) the second run to get past
# the write fails on it, as a reader of a half-written file would.
SCRIPT = """
import os, sys
with open("shard.bin", "wb") as f:
    f.write(bytes(1000))
try:
    os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL))
except FileExistsError:
    if sys.argv[2] == "one":
        raise ValueError("corrupted record at 40")
if sys.argv[2] == "both":
    raise ValueError("corrupted record at 40")
""" + tiny_training(3)


def _run(tmp_path: Path, fails_in: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = run_cli("run", "-q", "--no-verify", str(script), str(tmp_path / "first.mark"),
                     fails_in, cwd=tmp_path, timeout=BOUND)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the script failed in run" in result.stderr
    return result.stderr


def test_a_failure_in_one_run_only_names_the_files_the_runs_wrote_side_by_side(
        tmp_path: Path) -> None:
    err = _run(tmp_path, "one")
    assert "ValueError: corrupted record at 40" in err
    assert "failed in that run only" in err and "shard.bin" in err, err
    assert "--schedule sequential" in err


def test_a_failure_in_both_runs_is_the_scripts_alone(tmp_path: Path) -> None:
    err = _run(tmp_path, "both")
    assert "ValueError: corrupted record at 40" in err
    assert "--schedule sequential" not in err, err


def test_files_written_since_are_listed_newest_first_without_hidden_folders(
        tmp_path: Path) -> None:
    old = tmp_path / "data.csv"
    old.write_text("x")
    os.utime(old, (time.time() - 3600,) * 2)
    since = time.time() - 60
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.log").write_text("a")
    newest = tmp_path / "ckpt.pt"
    newest.write_text("b")
    os.utime(newest, (time.time() + 5,) * 2)
    (tmp_path / ".nondet").mkdir()
    (tmp_path / ".nondet" / "run-a.h5").write_text("c")
    (tmp_path / "results").mkdir()  # `--out results`: an invocation's folder, nondet's own
    (tmp_path / "results" / outdir.MARKER).write_text("{}")
    (tmp_path / "results" / "run-b.log").write_text("d")
    assert run_collisions.written_since(str(tmp_path), since) == [
        "ckpt.pt", os.path.join("logs", "a.log")]
    # `nondet run ... > out.txt`: the file nondet's own output goes to is nondet's
    with open(tmp_path / "out.txt", "w") as out:
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            listed = run_collisions.written_since(str(tmp_path), since, most=5)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    assert "out.txt" not in listed and "ckpt.pt" in listed
    assert run_collisions.written_since(str(tmp_path), since, most=1) == ["ckpt.pt"]
    assert run_collisions.side_by_side_hint([]) == ""
