"""The script owns every descriptor but nondet's two: closing all it inherited keeps the run
recorded, and a number it reuses for a file of its own is never written, read or closed
by nondet (trial: ``os.closerange(3, 1024)`` then ``open(...)`` wrote frames into the
user's file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nondet import channel, fdguard


@pytest.fixture(autouse=True)
def _fresh_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    # numbers claimed here are closed and reused by later tests: forget them afterwards
    monkeypatch.setattr(fdguard, "_CLAIMED", {})


def _replace_with_file(fd: int, path: Path, text: bytes = b"") -> int:
    """What the script does: our number now names a file of its own."""
    path.write_bytes(text)
    own = os.open(path, os.O_RDWR)
    os.dup2(own, fd)
    os.close(own)
    return fd


def test_frames_are_never_written_into_a_file_that_took_the_pipes_number(
        tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    writer = channel.FrameWriter(write_end)
    writer.send_json(channel.META, {"before": 1})
    writer.flush()
    assert os.read(read_end, 1 << 16)  # the pipe works
    _replace_with_file(write_end, tmp_path / "user.txt")
    writer.send_json(channel.META, {"after": 2})
    writer.flush()
    writer.close()
    assert (tmp_path / "user.txt").read_bytes() == b""
    os.fstat(write_end)  # still open: the script's file was not closed by nondet
    os.close(write_end)
    os.close(read_end)


def test_the_control_pipe_is_never_read_through_a_file_that_took_its_number(
        tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    fdguard.claim(read_end)
    os.close(write_end)
    _replace_with_file(read_end, tmp_path / "user.txt", b"stop\nstop\n")
    assert not channel.stop_requested(read_end)
    assert channel.wait_for_grant(read_end, lambda step, index: None, timeout=1.0) == \
        (channel.FREE, 0)
    assert os.lseek(read_end, 0, os.SEEK_CUR) == 0  # not one byte of the file was read
    os.close(read_end)


def test_a_descriptor_never_claimed_is_used_as_before() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, channel.STOP)
    assert channel.stop_requested(read_end)
    os.close(read_end)
    os.close(write_end)


@pytest.fixture
def _restore_os(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "close", os.close)
    monkeypatch.setattr(os, "closerange", os.closerange)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _contiguous_descriptors(count: int) -> list[int]:
    """``count`` descriptors on /dev/null at consecutive numbers that were all free, so that
    closing their range closes nothing else of the test process (os.open takes the lowest
    free numbers, which can straddle a descriptor of an earlier test's library: closing a
    gloo loop's epoll descriptor so aborted a pytest worker)."""
    base = next(b for b in range(256, 4096)
                if not any(_is_open(fd) for fd in range(b, b + count)))
    own = os.open(os.devnull, os.O_RDONLY)
    for fd in range(base, base + count):
        os.dup2(own, fd)
    os.close(own)
    return list(range(base, base + count))


@pytest.mark.usefixtures("_restore_os")
def test_closing_every_inherited_descriptor_leaves_nondets_open() -> None:
    fds = _contiguous_descriptors(5)
    for fd in (fds[1], fds[3]):
        fdguard.claim(fd)
    fdguard.install((fds[1], fds[3]))
    os.closerange(fds[0], fds[-1] + 1)
    os.close(fds[1])
    assert [_is_open(fd) for fd in fds] == [False, True, False, True, False]
    for fd in (fds[1], fds[3]):
        os.close.__wrapped__(fd)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("_restore_os")
def test_a_file_the_script_put_at_nondets_number_is_the_scripts_to_close(
        tmp_path: Path) -> None:
    # else a pipe to a process of the script's would never see end-of-file: a hang
    read_end, write_end = os.pipe()
    fdguard.claim(write_end)
    fdguard.install((write_end,))
    _replace_with_file(write_end, tmp_path / "user.txt")
    os.close(write_end)
    with pytest.raises(OSError):
        os.fstat(write_end)
    os.close(read_end)
