"""The parent side of a run's stream: frames in, the capture file and a mirror of it out.

``RunStream`` stores each frame the child sends (``channel.KINDS``, one handler per kind)
in the run's HDF5 file and keeps in memory what the schedule and the pipeline read while
the run goes on: step rows, op records, strings, kept outputs, how the run ended. A write
that fails (disk full) stops the run and the stream is only drained from then on.
``launch.CapturedRun`` adds the child process.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from nondet import channel
from nondet.printable import as_utf8
from nondet.records import COMM_DTYPE, OP_DTYPE, STEP_DTYPE, TENSOR_DTYPE, Group
from nondet.store import CaptureWriter
from nondet.store.writer import hdf5_write_failed

#: How long rows may wait in nondet's memory before they are stored and flushed (Note [Rows
#: stored in batches] in store/writer.py): what a SIGKILLed nondet can lose at most.
STORE_SECONDS = 0.25

_ROW_BYTES = {channel.TENSORS: TENSOR_DTYPE.itemsize, channel.STEP: STEP_DTYPE.itemsize}


class RunStream:
    """One run's stream as the parent stores and mirrors it (see module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: CaptureWriter | None = None
        self.on_step: Callable[[Any, np.void], None] | None = None
        self.on_end: Callable[[Any], None] | None = None
        self.steps: list[np.void] = []
        self.ops: dict[int, list[np.ndarray]] = {}  # op records per step, as they arrive
        #: the data entries of each step (string id of the label, fingerprint): the live judge
        #: asks whether the step rows name a differing one (nondet.live, Early)
        self.data_rows: dict[int, list[tuple[int, int]]] = {}
        self.strings: list[str] = []
        self.kept: dict[tuple[int, int], list[np.ndarray]] = {}  # answers to dump requests
        self._incoming: dict[tuple[int, int], list[np.ndarray]] = {}
        self._dumps_done = threading.Condition()
        self.end: channel.End | None = None
        self.hook_error = ""
        self.unsupported = ""  # channel.META_UNSUPPORTED
        self.write_error = ""
        self.overlap_first_step = False  # channel.META_OVERLAP_FIRST_STEP
        self._end_reported = False
        self._pipe_closed = False
        # One handler per frame kind (channel.KINDS); a kind not listed is ignored.
        self._handlers: dict[bytes, Callable[[bytes], None]] = {
            channel.STEP: self._on_step_frame,
            channel.OPS: self._on_ops_frame,
            channel.TENSORS: self._on_tensors_frame,
            channel.COMM: self._on_comm_frame,
            channel.STRINGS: self._on_strings_frame,
            channel.META: self._on_meta_frame,
            channel.FACTS: self._on_facts_frame,
            channel.DUMP: self._on_dump_frame,
            channel.END: self._on_end_frame,
        }

    def request_stop(self) -> None:
        """Ask the run to stop (the process side provides it)."""
        raise NotImplementedError

    @property
    def ended(self) -> bool:
        """The run will send nothing more (END arrived, or its pipe closed)."""
        return self._end_reported

    def _close_writer(self, status: str, code: int | None,
                      attrs: dict[str, Any] | None = None) -> None:
        if self.writer is None:
            return
        try:
            self.writer.close(status, code, attrs)
        except OSError:
            pass  # disk full: the file keeps what was flushed at the last step
        except RuntimeError as exc:  # h5py, once a write failed: "truncate request failed"
            if not (self.write_error or hdf5_write_failed(exc)):
                raise

    def _ended(self) -> None:
        """Tell the owner once that this run will send no more steps."""
        if self._end_reported:
            return
        self._end_reported = True
        with self._dumps_done:
            self._dumps_done.notify_all()
        if self.on_end is not None:
            self.on_end(self)

    # -- frames ------------------------------------------------------------------------------------
    def _handle_frames(self, frames: list[tuple[bytes, bytes]]) -> None:
        """Store the frames of one read, in order, except that consecutive step and tensor
        rows are stored together (one HDF5 append and flush costs about 1 ms, whatever
        the rows: a run granted several short steps per turn sends them in one write).
        Any other frame (an end, a dump, metadata) first stores the rows before it."""
        rows: dict[bytes, list[bytes]] = {channel.TENSORS: [], channel.STEP: []}
        for kind, payload in frames:
            if kind in rows and len(payload) % _ROW_BYTES[kind] == 0:
                rows[kind].append(payload)  # (a torn row is stored alone: _handle says so)
                continue
            if kind not in (channel.OPS, channel.STRINGS):
                self._handle_rows(rows)
            self._handle(kind, payload)
        self._handle_rows(rows)

    def _handle_rows(self, rows: dict[bytes, list[bytes]]) -> None:
        for kind, payloads in rows.items():  # tensors first: a step row comes after its own
            if payloads:
                self._handle(kind, b"".join(payloads))
                payloads.clear()

    def _handle(self, kind: bytes, payload: bytes) -> None:
        """Store one frame. After a write failure the stream is only drained (so the child
        never blocks on a full pipe) until it ends."""
        if self.write_error and kind != channel.END:
            return
        handler = self._handlers.get(kind)
        if handler is None:
            return
        def store() -> None:
            ensure_space(self.path, len(payload))
            handler(payload)

        try:
            self._stored(store)
        except (ValueError, KeyError, TypeError) as exc:
            if self.write_error:
                return  # the capture was closed while this frame was stored
            # A frame nondet's own child side got wrong (a torn row, bad JSON) is a nondet
            # bug: the run ends as an internal error (exit 3, bug log), never as a verdict
            # on records with a hole; the rest of the stream is still drained.
            self.hook_error = self.hook_error or (
                f"malformed {kind!r} frame from the run ({len(payload)} bytes): "
                f"{type(exc).__name__}: {exc}")

    def store_due(self) -> None:
        """Store the rows that have waited long enough (Note [Rows stored in batches] in
        store/writer.py): the reading loop calls this between reads, so the rows of a run
        that goes quiet (a long step, an evaluation) reach the file within moments."""
        if self.writer is None or self.write_error:
            return
        try:
            self._stored(self.writer.store_due)
        except (ValueError, KeyError, TypeError) as exc:
            if not self.write_error:  # nondet's bug: the run ends as an internal error
                self.hook_error = self.hook_error or (
                    f"storing the run's rows failed: {type(exc).__name__}: {exc}")

    def _stored(self, write: Callable[[], None]) -> None:
        """Run one write to the capture; a refused write stops the run (``_write_failed``)."""
        try:
            write()
        except OSError as exc:  # the capture file cannot be written (disk full, I/O error)
            self._write_failed(exc, self.path)
        except RuntimeError as exc:
            if not hdf5_write_failed(exc):
                raise
            self._write_failed(OSError(str(exc)), self.path)  # h5py's flush: same trouble
        except (ValueError, KeyError, TypeError):
            raise
        except Exception:
            if not self.write_error:
                raise
            # the log writer failed and closed the capture while this frame was stored

    def _write_failed(self, exc: OSError, path: Path) -> None:
        if self.write_error:
            return
        self.write_error = write_failure(path, exc)
        self.request_stop()
        self._close_writer(channel.WRITE_FAILED, None)

    def _on_step_frame(self, payload: bytes) -> None:
        assert self.writer is not None
        rows = np.frombuffer(payload, dtype=STEP_DTYPE)  # one or more (_handle_frames)
        self.writer.add_step(rows)
        for row in rows:
            self.steps.append(row)
            if self.on_step is not None:
                self.on_step(self, row)

    def _on_ops_frame(self, payload: bytes) -> None:
        assert self.writer is not None
        rows = np.frombuffer(payload, dtype=OP_DTYPE)
        self.writer.add_ops(rows)
        if len(rows):
            self.ops.setdefault(int(rows["step"][0]), []).append(rows)

    def _on_tensors_frame(self, payload: bytes) -> None:
        assert self.writer is not None
        rows = np.frombuffer(payload, dtype=TENSOR_DTYPE)
        self.writer.add_tensors(rows)
        data = rows[rows["group"] == Group.DATA]
        for step, name, fp in zip(data["step"].tolist(), data["name"].tolist(),
                                  data["fp"].tolist(), strict=True):
            self.data_rows.setdefault(step, []).append((name, fp))

    def _on_comm_frame(self, payload: bytes) -> None:
        assert self.writer is not None
        self.writer.add_comm(np.frombuffer(payload, dtype=COMM_DTYPE))

    def _on_strings_frame(self, payload: bytes) -> None:
        assert self.writer is not None
        # as the capture keeps them (file names that are not UTF-8: Note [Text from the program])
        strings = [as_utf8(str(text)) for text in json.loads(payload)]
        self.writer.add_strings(strings)
        self.strings.extend(strings)

    def _on_meta_frame(self, payload: bytes) -> None:
        assert self.writer is not None
        meta = json.loads(payload)
        if channel.META_ENV in meta:
            self.writer.add_env(meta[channel.META_ENV])
        if channel.META_OP_STEPS in meta:
            self.writer.set_op_steps(list(meta[channel.META_OP_STEPS]))
        if channel.META_HOOK_ERROR in meta:
            self.hook_error = meta[channel.META_HOOK_ERROR]
        if channel.META_UNSUPPORTED in meta:
            self.unsupported = self.unsupported or str(meta[channel.META_UNSUPPORTED])
        if meta.get(channel.META_OVERLAP_FIRST_STEP):
            self.overlap_first_step = True
        if channel.META_DUMP_DONE in meta:
            step, index, _ = meta[channel.META_DUMP_DONE]
            with self._dumps_done:
                self.kept[(step, index)] = self._incoming.pop((step, index), [])
                self._dumps_done.notify_all()

    def _on_facts_frame(self, payload: bytes) -> None:
        assert self.writer is not None
        self.writer.add_facts(json.loads(payload))

    def _on_dump_frame(self, payload: bytes) -> None:
        assert self.writer is not None
        dump = channel.Dump.decode(payload)
        self.writer.add_dump(dump.name, dump.array, dump.attrs)
        position = dump.kept_position
        if position is not None:
            self._incoming.setdefault(position, []).append(dump.array)

    def _on_end_frame(self, payload: bytes) -> None:
        self.end = channel.End.decode(json.loads(payload))
        self._ended()


#: Space left free on the capture's filesystem: HDF5 cannot be stopped cleanly once a write
#: has failed (it may leave the file unreadable, or crash in h5py), so nondet stops writing
#: while there is still room to close the file (everything before the last step is flushed).
RESERVE_BYTES = 1 << 20


def ensure_space(path: Path, nbytes: int) -> None:
    """Raise ENOSPC before a write that would leave less than RESERVE_BYTES free (rows
    waiting to be stored fit in it: CaptureWriter.MAX_PENDING_BYTES)."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return  # cannot tell: let the write itself say
    if st.f_bavail * st.f_frsize < RESERVE_BYTES + 2 * nbytes:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))


def write_failure(path: Path, exc: OSError) -> str:
    """One line for a capture or log that cannot be written."""
    text = str(exc)
    if exc.errno == errno.ENOSPC or "No space left" in text or "errno = 28" in text:
        return f"no space left on {_mount_point(path)} while writing {path}"
    reason = re.search(r"error message = '([^']*)'", text)  # HDF5's own text holds the cause
    if reason:
        return f"cannot write {path}: {reason.group(1)}"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"cannot write {path}: {first}"


def _mount_point(path: Path) -> str:
    current = os.path.realpath(path.parent)
    while not os.path.ismount(current) and os.path.dirname(current) != current:
        current = os.path.dirname(current)
    return current
