"""Per-invocation capture directories: nondet deletes only what it can prove it made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nondet import outdir
from nondet.errors import NondetError


def _user_tree(root: Path) -> dict[Path, bytes]:
    """Files a user may well have where captures go, some named exactly like nondet's."""
    files = {
        root / "run-notes.log": b"my notes",
        root / "run-experiment.h5": b"my data",
        root / "run-a.h5": b"an old capture, or the user's own file",
        root / "run-baseline.h5": b"a baseline kept next to the captures",
        root / "latest": b"the user's own file called latest",
        # Named like an invocation directory, but nondet never wrote a marker in it:
        root / "20200101-000000-1" / "run-a.h5": b"not nondet's",
        # A real (old) invocation directory that someone added a file to:
        root / "20200101-000001-1" / "keep-me.txt": b"added by the user",
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    _mark(root / "20200101-000001-1", pid=_dead_pid())
    return files


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def _mark(path: Path, pid: int) -> None:
    import socket

    marker = {"magic": outdir.MAGIC, "pid": pid, "host": socket.gethostname()}
    (path / outdir.MARKER).write_text(json.dumps(marker))


def _old_invocation(root: Path, name: str, pid: int) -> Path:
    path = root / name
    path.mkdir(parents=True)
    _mark(path, pid)
    for made in ("run-a.h5", "run-a.log"):  # as nondet's runs make them: listed first
        outdir.claim(path / made)
        (path / made).write_bytes(made.encode())
    return path


def test_each_invocation_gets_its_own_marked_directory(tmp_path: Path) -> None:
    first, second = outdir.start(tmp_path), outdir.start(tmp_path)
    assert first.path != second.path and first.path.parent == second.path.parent == tmp_path
    assert outdir.is_invocation(first.path) and outdir.is_own(second.path)
    assert not outdir.is_invocation(tmp_path)


def test_user_files_survive_start_prune_and_finish(tmp_path: Path) -> None:
    files = _user_tree(tmp_path)
    dead = _dead_pid()
    for i in range(outdir.KEEP + 3):
        _old_invocation(tmp_path, f"20210101-00000{i}-{dead}", dead)
    for _ in range(3):
        outdir.finish(outdir.start(tmp_path))
    for path, data in files.items():
        assert path.read_bytes() == data, path
    assert not (tmp_path / "latest").is_symlink()  # the user's `latest` is not replaced
    assert (tmp_path / "20200101-000001-1" / outdir.MARKER).exists()


def test_prune_removes_only_old_unused_marked_directories(tmp_path: Path) -> None:
    dead = _dead_pid()
    old = [_old_invocation(tmp_path, f"20210101-00000{i}-{dead}", dead) for i in range(4)]
    alive = _old_invocation(tmp_path, f"20210101-000000-{os.getpid()}.1", os.getpid())
    removed = outdir.prune(tmp_path, keep=2)
    # The two newest stay; of the older ones, the one whose process still runs stays too.
    assert sorted(removed) == sorted(old[:2]) and all(not p.exists() for p in old[:2])
    assert all(p.exists() for p in (*old[2:], alive))


def test_files_named_like_nondets_that_it_did_not_make_are_kept(tmp_path: Path) -> None:
    """A user's ``run-notes.log`` or ``run-final.h5`` put into an old invocation directory
    was deleted with it: their names match nondet's, but nondet did not list them."""
    dead = _dead_pid()
    old = [_old_invocation(tmp_path, f"20210101-00000{i}-{dead}", dead) for i in range(4)]
    (old[0] / "run-notes.log").write_bytes(b"my notes")
    (old[1] / "run-final.h5").write_bytes(b"my weights")
    unlisted = tmp_path / f"20200101-000000-{dead}"  # made before nondet listed its files
    unlisted.mkdir()
    _mark(unlisted, dead)
    (unlisted / "run-a.h5").write_bytes(b"capture")
    assert outdir.prune(tmp_path, keep=1) == [old[2]]
    assert (old[0] / "run-notes.log").read_bytes() == b"my notes"
    assert (old[1] / "run-final.h5").read_bytes() == b"my weights"
    assert (unlisted / "run-a.h5").exists() and old[3].exists()


def test_latest_points_at_the_invocation_that_finished_last(tmp_path: Path) -> None:
    first, second = outdir.start(tmp_path), outdir.start(tmp_path)
    outdir.finish(second)
    outdir.finish(first)
    latest = tmp_path / "latest"
    assert latest.is_symlink() and latest.resolve() == first.path.resolve()
    assert not list(tmp_path.glob(".latest*"))  # no temporary link left behind


def test_out_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(NondetError, match="is a file, not a directory"):
        outdir.start(tmp_path / "file" / "sub" / "out")


def test_out_on_a_named_pipe_says_what_it_is(tmp_path: Path) -> None:
    """Faults round 10: a FIFO given to --out was "a file"."""
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(NondetError, match="pipe is a named pipe, not a directory"):
        outdir.start(tmp_path / "pipe")


def test_read_only_out_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root writes into read-only directories, so the check is exercised through os.access.
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(NondetError, match="not writable"):
        outdir.start(tmp_path / "out")
    assert not (tmp_path / "out").exists()
