"""The parent side of a run without a subprocess: frames in, capture file and state out."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from nondet import channel, schedule
from nondet.errors import NondetError
from nondet.launch import CapturedRun, Plan, Target
from nondet.records import OP_DTYPE, STEP_DTYPE
from nondet.store import CaptureWriter, open_capture
from nondet.stream import write_failure


def _run(tmp_path: Path) -> tuple[CapturedRun, int]:
    """A CapturedRun whose capture is open and whose control pipe we read (fd returned)."""
    run = CapturedRun(Target(None, "train"), Plan("a", []), 0, tmp_path)
    run.writer = run._open_writer()
    ctrl_r, run._ctrl_w = os.pipe()
    return run, ctrl_r


def _step(step: int, fp: int = 0) -> bytes:
    row = np.zeros(1, dtype=STEP_DTYPE)
    row["step"], row["params_fp"] = step, max(fp, 0)
    return row.tobytes()


def _ops(step: int, n: int = 2) -> bytes:
    rows = np.zeros(n, dtype=OP_DTYPE)
    rows["step"], rows["index"] = step, np.arange(n)
    return rows.tobytes()


def _frames(steps: range) -> list[tuple[bytes, bytes]]:
    frames = [(channel.META, json.dumps({channel.META_ENV: {"python_version": "3"}}).encode()),
              (channel.STRINGS, json.dumps(["aten.mm.default"]).encode())]
    for step in steps:
        frames += [(channel.OPS, _ops(step)), (channel.STEP, _step(step, fp=step))]
    return frames


def test_every_frame_kind_has_a_handler(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    assert set(run._handlers) == set(channel.KINDS)


def test_frames_are_stored_and_mirrored(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    seen: list[int] = []
    run.on_step = lambda r, row: seen.append(int(row["step"]))
    for kind, payload in _frames(range(-1, 2)):
        run._handle(kind, payload)
    run._handle(channel.FACTS, json.dumps({"loader": {"workers": 2}}).encode())
    run._handle(channel.META, json.dumps({channel.META_HOOK_ERROR: "Traceback: x"}).encode())
    dump = channel.Dump(channel.kept_name(0, 1, 0), np.arange(3.0), {"step": 0, "index": 1})
    run._handle(channel.DUMP, dump.encode())
    run._handle(channel.META, json.dumps({channel.META_DUMP_DONE: [0, 1, 1]}).encode())
    run._handle(channel.END, json.dumps(channel.End(channel.COMPLETE, 0, "",
                                                    {"final_params_fp": 9}).encode()).encode())
    assert seen == [-1, 0, 1] and run.ended
    assert run.hook_error == "Traceback: x" and sorted(run.ops) == [-1, 0, 1]
    assert [a.tolist() for a in run.kept[(0, 1)]] == [[0.0, 1.0, 2.0]]
    result = run._result(0)
    assert (result.status, result.steps, result.final) == ("complete", 2,
                                                          {"final_params_fp": 9})
    capture = open_capture(run.path)
    assert capture.n_steps == 2 and capture.facts["loader"] == {"workers": 2}
    assert capture.env["python_version"] == "3" and len(capture.ops(0)) == 2
    assert "kept-0-1-out0" in capture.dumps


def test_an_unknown_frame_kind_is_ignored(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    run._handle(b"Z", b"from a newer child")
    run._handle(channel.STEP, _step(0))
    assert len(run.steps) == 1


@pytest.mark.parametrize(("kind", "payload"), [
    (channel.STEP, _step(0)[:10]),  # a torn step row
    (channel.OPS, _ops(0)[:70]),  # one op record and a piece of the next
    (channel.META, b'{"env": '),  # cut-off JSON
], ids=["step", "ops", "meta"])
def test_a_truncated_frame_is_nondets_error_and_the_stream_goes_on(
        tmp_path: Path, kind: bytes, payload: bytes) -> None:
    run, _ = _run(tmp_path)
    run._handle(kind, payload)  # never raises into the pump thread
    run._handle(channel.STEP, _step(0))
    assert len(run.steps) == 1  # later frames are still stored
    run._handle(channel.END, json.dumps(channel.End(channel.COMPLETE, 0).encode()).encode())
    with pytest.raises(schedule.InternalChildError, match="malformed"):
        schedule.check_result(run._result(0))  # exit 3, not a verdict or "the script failed"


def _full_disk_after(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Make the capture writer fail as a full disk does once ops of ``step`` arrive."""
    original = CaptureWriter.add_ops

    def add_ops(self: CaptureWriter, rows: np.ndarray) -> None:
        if len(rows) and int(rows["step"][0]) >= step:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, rows)

    monkeypatch.setattr(CaptureWriter, "add_ops", add_ops)


def test_disk_full_stops_the_run_and_keeps_the_capture_readable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _full_disk_after(monkeypatch, step=2)
    run, ctrl_r = _run(tmp_path)
    seen: list[int] = []
    run.on_step = lambda r, row: seen.append(int(row["step"]))
    for kind, payload in _frames(range(-1, 5)):
        run._handle(kind, payload)  # never raises into the pump thread
    run._handle(channel.END, json.dumps(channel.End(channel.STOPPED, 0).encode()).encode())
    assert run.write_error == f"no space left on {write_failure_mount(tmp_path)} while " \
                              f"writing {run.path}"
    assert channel.STOP in os.read(ctrl_r, 100)  # the run was told to stop
    assert seen == [-1, 0, 1]  # nothing after the failure reaches the schedule
    result = run._result(0)
    assert result.status == channel.WRITE_FAILED
    capture = open_capture(run.path)  # readable, up to the last complete step
    assert capture.status == "write_failed" and capture.n_steps == 2
    with pytest.raises(NondetError, match=r"no space left on .* while writing .*run-a\.h5"):
        schedule.check_result(result)


def write_failure_mount(path: Path) -> str:
    from nondet.stream import _mount_point

    return _mount_point(path / "x")


def test_disk_full_keeps_draining_so_the_child_never_blocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the failure the pump still reads everything (far more than a pipe holds)."""
    _full_disk_after(monkeypatch, step=0)
    run, _ = _run(tmp_path)
    data_r, data_w = os.pipe()
    pump = threading.Thread(target=run._pump_frames, args=(data_r,), daemon=True)
    pump.start()
    writer = channel.FrameWriter(data_w)

    def child() -> None:
        for kind, payload in _frames(range(-1, 2000)):  # ~ 2000 x 200 bytes
            writer.send(kind, payload)
        writer.send_json(channel.END, channel.End(channel.STOPPED, 0).encode())
        writer.flush()
        writer.close()

    sender = threading.Thread(target=child, daemon=True)
    sender.start()
    sender.join(20)
    pump.join(20)
    assert not sender.is_alive() and not pump.is_alive()
    assert run.write_error.startswith("no space left") and run.ended


def test_other_write_errors_are_one_line_too(tmp_path: Path) -> None:
    line = write_failure(tmp_path / "run-a.h5", OSError(errno.EIO, "Input/output error"))
    assert line == f"cannot write {tmp_path / 'run-a.h5'}: [Errno 5] Input/output error"


def test_h5py_style_disk_full_message_is_recognized(tmp_path: Path) -> None:
    exc = OSError("Can't write data (file write failed: time = ..., errno = 28, error message "
                  "= 'No space left on device')")
    assert write_failure(tmp_path / "r.h5", exc).startswith("no space left on ")


def test_control_words_are_not_sent_after_the_pipe_is_closed(tmp_path: Path) -> None:
    run, ctrl_r = _run(tmp_path)
    run._close_control()
    run.send_control(channel.STOP)  # no error, and no write to a reused descriptor
    assert os.read(ctrl_r, 10) == b""  # EOF: nothing was written
    os.close(ctrl_r)


def test_disk_full_before_the_run_starts_is_one_line(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: CaptureWriter, path: Path, attrs: dict[str, object],
             store_every: float = 0.0) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CaptureWriter, "__init__", full)
    run = CapturedRun(Target(None, "train"), Plan("a", []), 0, tmp_path)
    with pytest.raises(NondetError, match=r"^no space left on /\S* while writing "):
        run.start()
    assert not run.running()
