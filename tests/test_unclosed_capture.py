"""A capture whose writer was SIGKILLed (``kill -9``, a CI timeout, the OOM killer) reads up
to its last flush, without nondet writing the file (Note [Unclosed captures])."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from nondet.store import open_capture
from nondet.store.unclosed import closed_superblock, lookup3
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parent.parent

# The writer of tests.conftest, killed where it would close the file: two steps flushed.
_KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from nondet.store.writer import CaptureWriter
from tests.conftest import step_rows, write_capture
CaptureWriter.close = lambda self, status, code: os.kill(os.getpid(), signal.SIGKILL)
write_capture(Path(sys.argv[1]), step_rows({{"step": -1, "params_fp": 1}},
              {{"step": 0, "loss": 0.5, "params_fp": 2}}, {{"step": 1, "params_fp": {last}}}))
"""


def _killed_capture(path: Path, last: int = 3) -> Path:
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER.format(repo=str(REPO),
                                                                        last=last), str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr  # killed, as meant: the file was never closed
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_lookup3_gives_the_reference_values() -> None:
    # the test vectors of Jenkins' lookup3.c (driver5)
    assert lookup3(b"") == 0xDEADBEEF
    assert lookup3(b"", 0xDEADBEEF) == 0xBD5B7DDE
    assert lookup3(b"Four score and seven years ago") == 0x17770551
    assert lookup3(b"Four score and seven years ago", 1) == 0xCD628161


def test_a_killed_writers_capture_reads_up_to_its_last_flush(tmp_path: Path) -> None:
    path = _killed_capture(tmp_path / "run-a.h5")
    before = _digest(path)
    capture = open_capture(path)
    capture.verify()
    assert capture.unclosed and capture.status == "interrupted"
    assert capture.n_steps == 2 and list(capture.steps["params_fp"]) == [1, 2, 3]
    assert _digest(path) == before  # read, never written (h5clear would have)
    shown = run_cli("show", str(path), cwd=tmp_path, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "its writer was killed" in shown.stdout


def test_two_killed_captures_are_compared_step_by_step(tmp_path: Path) -> None:
    _killed_capture(tmp_path / "run-a.h5")
    _killed_capture(tmp_path / "run-b.h5", last=4)
    done = run_cli("diff", "--json", "report.json", "run-a.h5", "run-b.h5", cwd=tmp_path,
                   timeout=120)
    assert done.returncode == 1, done.stderr  # step 1's parameters differ
    assert "step 1" in done.stdout, done.stdout


@pytest.mark.parametrize("damage", ["checksum", "signature"])
def test_a_superblock_that_does_not_check_out_is_left_to_hdf5(tmp_path: Path,
                                                              damage: str) -> None:
    path = _killed_capture(tmp_path / "run-a.h5")
    head = bytearray(path.read_bytes()[:64])
    assert closed_superblock(bytes(head)) is not None
    head[20 if damage == "checksum" else 1] ^= 0x01
    assert closed_superblock(bytes(head)) is None
