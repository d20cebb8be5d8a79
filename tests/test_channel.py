"""The wire format between a captured run and nondet: every message schema round-trips."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from nondet import channel
from nondet.records import STEP_DTYPE


def _pipe_frames(send: list[tuple[bytes, bytes]], chunk: int) -> list[tuple[bytes, bytes]]:
    """Write frames with a FrameWriter, read them back in ``chunk``-byte pieces."""
    r, w = os.pipe()
    writer = channel.FrameWriter(w)
    for kind, payload in send:
        writer.send(kind, payload)
    writer.flush()
    writer.close()
    parser = channel.FrameParser()
    got = []
    with os.fdopen(r, "rb") as f:
        while data := f.read(chunk):
            got += parser.feed(data)
    return got


@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_frames_round_trip_whatever_the_read_size(chunk: int) -> None:
    row = np.zeros(1, dtype=STEP_DTYPE)
    row["step"] = 3
    frames = [(channel.STEP, row.tobytes()), (channel.META, b"{}"), (channel.END, b"")]
    assert _pipe_frames(frames, chunk) == frames


def test_a_torn_frame_waits_for_the_rest() -> None:
    parser = channel.FrameParser()
    whole = channel._HEADER.pack(channel.OPS, 5) + b"abcde"
    assert parser.feed(whole[:7]) == []
    assert parser.feed(whole[7:]) == [(channel.OPS, b"abcde")]


def test_frame_kinds_are_distinct_single_bytes() -> None:
    assert len(set(channel.KINDS)) == len(channel.KINDS)
    assert all(len(kind) == 1 for kind in channel.KINDS)


def test_end_round_trips_and_keeps_only_final_digests() -> None:
    end = channel.End(channel.FAILED, 1, "Traceback ...\nValueError: boom",
                      {"final_params_fp": 12345})
    wire = end.encode()
    assert channel.End.decode(dict(wire, unrelated=1)) == end
    assert wire[channel.END_STATUS] == "failed"


def test_end_error_is_bounded() -> None:
    assert len(channel.End(channel.FAILED, 1, "x" * 50_000).encode()[channel.END_ERROR]) == 20_000


def test_an_end_without_fields_means_complete() -> None:
    assert channel.End.decode({}) == channel.End(channel.COMPLETE, 0)


@pytest.mark.parametrize("array", [np.arange(6, dtype=np.float32).reshape(2, 3),
                                   np.zeros((0, 4), dtype=np.int64),
                                   np.array(7, dtype=np.uint8)])
def test_dump_round_trips_values_shape_dtype_and_attrs(array: np.ndarray) -> None:
    dump = channel.Dump(channel.kept_name(2, 9, 0), array, {"step": 2, "index": 9})
    back = channel.Dump.decode(dump.encode())
    assert back.name == "kept-2-9-out0" and back.attrs == {"step": 2, "index": 9}
    assert back.array.dtype == array.dtype and back.array.shape == array.shape
    assert np.array_equal(back.array, array)
    assert back.kept_position == (2, 9)


def test_a_dump_not_asked_for_has_no_kept_position() -> None:
    assert channel.Dump("finding-out0", np.zeros(1), {"step": 1}).kept_position is None


def _control(words: bytes) -> int:
    r, w = os.pipe()
    os.write(w, words)
    os.close(w)
    return r


def test_wait_for_turn_answers_dump_requests_and_stop_wins() -> None:
    asked: list[tuple[int, int]] = []
    fd = _control(channel.dump_request(3, 41) + channel.GO + channel.STOP)
    assert channel.wait_for_turn(fd, lambda s, i: asked.append((s, i))) == channel.STOP
    assert asked == [(3, 41)]
    os.close(fd)


def test_wait_for_turn_treats_a_closed_pipe_as_the_parent_gone() -> None:
    # GONE (the run stops), no longer FREE (it trained on as an orphan of a killed nondet)
    fd = _control(b"")
    assert channel.wait_for_turn(fd, lambda s, i: None) == channel.GONE
    os.close(fd)


def test_wait_for_turn_ends_after_its_timeout() -> None:
    r, w = os.pipe()
    start = time.monotonic()
    assert channel.wait_for_turn(r, lambda s, i: None, timeout=0.2) == channel.FREE
    assert 0.15 < time.monotonic() - start < 5
    os.close(r)
    os.close(w)


def test_wait_for_turn_without_timeout_waits_for_a_word() -> None:
    r, w = os.pipe()
    answer: list[bytes] = []
    thread = threading.Thread(target=lambda: answer.append(
        channel.wait_for_turn(r, lambda s, i: None)), daemon=True)
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive()
    os.write(w, channel.GO)
    thread.join(5)
    assert answer == [channel.GO]
    os.close(r)
    os.close(w)


def test_stop_requested_never_blocks() -> None:
    r, w = os.pipe()
    assert channel.stop_requested(r) is False
    os.write(w, channel.STOP)
    assert channel.stop_requested(r) is True
    os.close(r)
    os.close(w)


def test_a_forked_process_never_writes_the_frames_it_inherited() -> None:
    """A run that forks (a DataLoader worker, os.fork) while frames wait in its buffer (a
    lockstep grant holds step rows back): the copy must not send them a second time, even
    when it flushes or its interpreter finalizes."""
    r, w = os.pipe()
    writer = channel.FrameWriter(w)
    writer.send(channel.STEP, b"row of step 7")
    pid = os.fork()
    if pid == 0:  # the forked copy: flushes, and exits the way a finalizing one would
        writer.flush()
        writer.close()
        os._exit(0)
    os.waitpid(pid, 0)
    writer.flush()
    writer.close()
    parser = channel.FrameParser()
    with os.fdopen(r, "rb") as f:
        frames = parser.feed(f.read())
    assert frames == [(channel.STEP, b"row of step 7")]
