"""The pipe between a recorded run (child) and nondet (parent).

The child never writes the HDF5 file itself: it streams framed messages and the parent
writes them. A child that crashes or is killed therefore cannot corrupt its capture; the
parent closes the file, marked incomplete, with everything up to the last whole message.

Frame: 1 byte type, 4 bytes little-endian length, payload. JSON payloads for metadata,
raw NumPy bytes (dtypes in ``records``) for rows.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nondet import fdguard, own_os, own_threads

#: Bound at import, before the script runs: a script that replaces ``json.dumps`` (a
#: JSON policy, a monkeypatch for its own logging) must not change, or break, what nondet
#: sends. Its error surfaced at the script's ``torch.manual_seed``: "the script failed".
_dumps = json.dumps

# -- frame kinds, child -> parent ----------------------------------------------------------------
META = b"M"  # JSON: root attributes and environment entries (may repeat; later keys win)
STRINGS = b"S"  # JSON list of new strings, ids continue from the previous message
STEP = b"P"  # one STEP_DTYPE row
TENSORS = b"T"  # TENSOR_DTYPE rows
OPS = b"O"  # OP_DTYPE rows of one step
COMM = b"C"  # COMM_DTYPE rows of one step: backend, group size, bucket of each collective
FACTS = b"F"  # JSON: facts the recipe matcher uses (loader settings, unseeded RNGs, ...)
DUMP = b"D"  # JSON header line, then raw array bytes
END = b"E"  # JSON: {"status": complete|stopped|failed|interrupted, ...}
#: JSON {"rank", "world_size", "local_rank", "pid"}: the first frame of a rank of a
#: distributed job, which reaches the parent over a Unix socket (``connect``), not a pipe
HELLO = b"H"

# HELLO opens a rank's socket and is read by nondet.distributed before the stream starts
KINDS = (META, STRINGS, STEP, TENSORS, OPS, COMM, FACTS, DUMP, END)

# -- META keys (one message may carry several) ---------------------------------------------------
META_ENV = "env"  # dict: environment entries (versions, devices, variables)
META_HOOK_ERROR = "hook_error"  # str: traceback of an exception inside nondet's hooks
META_DUMP_DONE = "dump_done"  # [step, index, count]: every kept output of a dump request sent
META_OP_STEPS = "op_steps"  # list: the run records ops at these steps, not the planned ones
#: str: the script does something nondet cannot record (training in two threads at once):
#: the run stopped itself; the parent reports this line (exit 2), never a comparison
META_UNSUPPORTED = "unsupported"
#: true: this run's first training step is mostly single-threaded work (TensorFlow traces
#: its step function there), so lockstep lets both runs compute it at once (turns.Turns)
META_OVERLAP_FIRST_STEP = "overlap_first_step"

# -- END payload -------------------------------------------------------------------------------
END_STATUS = "status"
END_EXIT_CODE = "exit_code"
END_ERROR = "error"  # the script's traceback, if it raised
FINAL_PREFIX = "final_"  # final_params_fp, ...: digests of the end state

# -- FACTS keys sent by the recorded run itself (others come from the backends) ---------------
#: digest of the tensors handed to the K-th child process (creation order), read when the
#: parent joined it: training in children shows up here (frameworks/torch/children.py)
CHILD_PARAMS_FACT = "child#{}.params_fp"
#: Prefix of an entry's name in the parent: a tensor handed to child K, read after its join.
CHILD_ENTRY_PREFIX = "child:"
CHILD_PARAMS_PREFIX = "child#"
#: Fact: the run started process pool workers (multiprocessing.Pool, ProcessPoolExecutor),
#: which are not recorded (frameworks/torch/children.py)
POOL_FACT = "python.pool_workers"
#: fact: the script imported JAX (Keras 3 on its JAX backend, or JAX itself), which
#: nondet does not record (boot.py): said when no step was observed
JAX_FACT = "python.jax_imported"
#: Fact: an optimizer was given its parameters as a set (torch/owners.py); with ".line" the
#: user's line that made it.
OPTIMIZER_PARAMS_SET = "torch.optimizer_params_set"


def child_frames_path(children_dir: str, label: str) -> str:
    """Where a recorded child process of a run writes its frames (``run-a.child0.frames``):
    the same frames as over the pipe, into a file of its own, stored by the parent as
    ``run-a.child0.h5`` once the run has ended (``child_captures``)."""
    return os.path.join(children_dir, f"run-{label}.frames")

# How a run ended (the END status, and the capture's ``status`` attribute):
COMPLETE = "complete"  # the script ended on its own, exit code 0
STOPPED = "stopped"  # nondet stopped it on purpose at a step boundary
FAILED = "failed"  # the script raised or exited non-zero
INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM
CRASHED = "crashed"  # the child died without saying how (a signal, os._exit)
WRITE_FAILED = "write_failed"  # the parent could not write the capture (disk full)
RUNNING = "running"  # the capture is still being written (or its writer died)
STATUSES = (COMPLETE, STOPPED, FAILED, INTERRUPTED, CRASHED, WRITE_FAILED, RUNNING)

#: Names of DUMP frames that answer a dump request: ``kept-STEP-INDEX-outN``.
KEPT_PREFIX = "kept-"

# Parent -> child on the control pipe (one word per line):
STOP = b"stop\n"  # stop at the next step boundary
GO = b"go\n"  # lockstep: run one more step, then wait again ("go N\n": N more steps, ``go``)
FREE = b"free\n"  # lockstep: stop waiting at step boundaries (the other run has ended)
DUMP_REQUEST = b"dump"  # lockstep: "dump STEP INDEX\n": send that record's kept outputs
#: Never sent: what the child reads when the parent is gone (end of file on the control pipe:
#: nondet killed by SIGKILL or the OOM killer). The run stops at its next step boundary
#: rather than train on for nobody, for good if the script never ends on its own.
GONE = b"gone\n"

_HEADER = struct.Struct("<cI")


class FrameWriter:
    """Child side. Buffered; ``flush`` at step ends and before exiting, or ``flush_later``
    inside a lockstep grant (the frames of several steps in one write). The buffer is
    nondet's own, not a file object's: a process forked while frames wait in it (a
    DataLoader worker, ``os.fork``) never writes them, not even when its interpreter
    finalizes, since only the process that made the writer flushes it (a copy of a step row
    in the stream would be stored twice)."""

    #: buffered bytes written out without waiting for a flush
    LIMIT = 1 << 16

    def __init__(self, fd: int) -> None:
        self._fd = fd
        fdguard.claim(fd)
        self._pid = own_os.getpid()
        self._buffer = bytearray()
        self._broken = False  # the reader is gone (or the descriptor closed)
        self.parent_gone = False  # the reader is gone: EPIPE (the session stops the run)
        self._lock = threading.Lock()  # the flusher thread (flush_later) writes too
        self._deadline: float | None = None
        self._wake = threading.Event()
        self._flusher = False  # its thread started

    def send(self, kind: bytes, payload: bytes) -> None:
        if own_os.getpid() != self._pid:
            return  # a forked copy (checked before the lock, which a fork may copy held)
        with self._lock:
            self._buffer += _HEADER.pack(kind, len(payload))
            self._buffer += payload
            if len(self._buffer) >= self.LIMIT:
                self._write()

    def send_json(self, kind: bytes, obj: Any) -> None:
        self.send(kind, _dumps(obj, default=str).encode())

    def flush(self) -> None:
        if own_os.getpid() != self._pid:
            return
        with self._lock:
            self._deadline = None
            self._write()

    def flush_later(self, seconds: float) -> None:
        """Leave the buffer for a later ``flush``, but have it written within ``seconds``
        whatever the script does meanwhile (it may sleep or evaluate for minutes after its
        last step: the parent must see that step)."""
        if own_os.getpid() != self._pid:
            return
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + seconds
                if not self._flusher:
                    try:  # Note [Threads the script cannot see] in own_threads.py
                        own_threads.start(self._flush_when_due)
                    except Exception:
                        # The script forbids threads (it replaced ``Thread.start``) or
                        # cannot start one (a thread limit): written now instead, as
                        # ``flush`` would; the next step tries again.
                        self._deadline = None
                        self._write()
                        return
                    self._flusher = True
                self._wake.set()

    def _flush_when_due(self) -> None:
        while not self._broken:
            self._wake.wait()
            with self._lock:
                deadline = self._deadline
                if deadline is None:
                    self._wake.clear()  # nothing pending: sleep until flush_later
                    continue
                if time.monotonic() >= deadline:
                    self._deadline = None
                    self._write()
                    continue
            time.sleep(max(0.0, deadline - time.monotonic()))

    def _write(self) -> None:
        """Write the buffer out (the lock is held)."""
        if self._broken:
            self._buffer.clear()  # nobody left to tell
            return
        view = memoryview(self._buffer)
        retries = 3  # closed under our feet again and again: give up rather than spin
        try:
            while view:
                # the script may close or replace ours (from C) at any moment: write only
                # through the number that still names the pipe, reopened if need be
                fd = fdguard.live(self._fd)
                if fd < 0:
                    self._broken = True  # closed or replaced, and not reopened: never write
                    break
                try:
                    view = view[own_os.write(fd, view):]
                except OSError as exc:
                    if exc.errno != errno.EBADF or retries == 0:
                        raise
                    retries -= 1
                    # closed between the check and the write: the check reopens it
        except OSError as exc:  # BrokenPipeError: the parent is gone; nothing left to tell it
            self._broken = True
            self.parent_gone = isinstance(exc, BrokenPipeError)
        finally:
            view.release()
            self._buffer.clear()

    def close(self) -> None:
        """Flush and close the descriptor (a run that ends; tests that play one)."""
        if own_os.getpid() != self._pid:
            return
        with self._lock:
            self._deadline = None
            self._write()
            fd = fdguard.live(self._fd) if self._fd >= 0 else -1
            if fd >= 0:  # never a number the script reused for a file of its own
                try:
                    # the real close: fdguard makes the script's os.close skip this one
                    getattr(os.close, "__wrapped__", os.close)(fd)
                except OSError:
                    pass
            fdguard.release(self._fd)  # the number may be reused for anything now
            self._fd = -1
            self._broken = True
            self._wake.set()  # the flusher thread ends


class FrameParser:
    """Parent side: feed raw bytes, get whole frames back (a torn tail waits for more)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buffer += data
        frames = []
        offset = 0
        buffer = self._buffer
        while len(buffer) - offset >= _HEADER.size:
            kind, length = _HEADER.unpack_from(buffer, offset)
            end = offset + _HEADER.size + length
            if end > len(buffer):
                break
            frames.append((kind, bytes(buffer[offset + _HEADER.size : end])))
            offset = end
        del buffer[:offset]
        return frames


def connect(path: str, hello: dict[str, Any], timeout: float = 60.0) -> tuple[int, int]:
    """Child side, a rank of a distributed job: connect to the parent's socket and say who
    we are. Returns (data fd, control fd): one socket, two descriptors, because the frame
    writer owns (and closes) its descriptor. torchrun does not pass inherited pipes on to
    its workers, so each rank dials in instead (see nondet/distributed.py)."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    sock.settimeout(None)
    payload = _dumps(hello).encode()
    sock.sendall(_HEADER.pack(HELLO, len(payload)) + payload)
    data_fd = sock.detach()
    return data_fd, own_os.dup(data_fd)


def stop_requested(fd: int) -> bool:
    """Child side: has the parent asked us to stop (or gone: end of file)? Never blocks."""
    fd = fdguard.live(fd)
    if fd < 0:
        return False  # the script closed or replaced the pipe: never read its file
    try:
        ready, _, _ = own_os.select([fd], [], [], 0)
    except (OSError, ValueError):
        return False
    if not ready:
        return False
    try:
        data = own_os.read(fd, 256)
    except OSError:
        return False
    return STOP in data or not data


def go(steps: int) -> bytes:
    """The GO word granting ``steps`` steps before the next wait (plain GO for one)."""
    return GO if steps <= 1 else f"go {steps}\n".encode()


def wait_for_turn(fd: int, on_dump: Callable[[int, int], None],
                  timeout: float | None = None) -> bytes:
    """Child side, lockstep: block until the parent says GO, FREE or STOP (STOP wins);
    answer DUMP requests (``on_dump(step, index)``) while waiting.

    A closed pipe (the parent is gone) is GONE. ``timeout`` seconds without a word (for
    waits the parent may not end) count as FREE: the run finishes on its own.
    """
    return wait_for_grant(fd, on_dump, timeout)[0]


def wait_for_grant(fd: int, on_dump: Callable[[int, int], None],
                   timeout: float | None = None) -> tuple[bytes, int]:
    """``wait_for_turn``, and how many steps a GO grants (1 unless "go N"; 0 otherwise)."""
    pending = b""
    deadline = None if timeout is None else time.monotonic() + timeout
    claimed = fd
    while True:
        fd = fdguard.live(claimed)
        if fd < 0:
            return FREE, 0  # the script closed or replaced the pipe: never read its file
        try:
            # a bounded wait even without a deadline: the script may close the pipe (from
            # C) while we wait, and the next turn reads it where it was reopened
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            ready, _, _ = own_os.select([fd], [], [], wait)
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    return FREE, 0
                continue
            data = own_os.read(fd, 256)
        except (OSError, ValueError):
            return FREE, 0
        if not data:
            return GONE, 0
        pending += data
        *lines, pending = pending.split(b"\n")
        words = [line.split() for line in lines if line.strip()]
        for word in words:
            if word[0] == DUMP_REQUEST and len(word) == 3:
                on_dump(int(word[1]), int(word[2]))
        kinds = {w[0] + b"\n" for w in words}
        for answer in (STOP, FREE):
            if answer in kinds:
                return answer, 0
        grants = [_granted(w) for w in words if w[0] + b"\n" == GO]
        if grants:
            return GO, max(grants)


def _granted(word: list[bytes]) -> int:
    """Steps a GO word grants: "go" one, "go N" N (a garbled count: one, as plain GO)."""
    if len(word) == 2 and word[1].isdigit():
        return max(1, int(word[1]))
    return 1


def dump_request(step: int, index: int) -> bytes:
    return DUMP_REQUEST + f" {step} {index}\n".encode()


@dataclass(frozen=True)
class End:
    """The END message: how the run ended, the script's error, final digests."""

    status: str
    exit_code: int
    error: str = ""
    final: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> dict[str, Any]:
        return {END_STATUS: self.status, END_EXIT_CODE: self.exit_code,
                END_ERROR: self.error[-20000:], **self.final}

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> End:
        return cls(status=str(obj.get(END_STATUS, COMPLETE)),
                   exit_code=int(obj.get(END_EXIT_CODE, 0)), error=str(obj.get(END_ERROR, "")),
                   final={k: v for k, v in obj.items() if k.startswith(FINAL_PREFIX)})


@dataclass(frozen=True)
class Dump:
    """A DUMP frame: one array and its attributes (a JSON header line, then raw bytes)."""

    name: str
    array: np.ndarray
    attrs: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        header = dict(self.attrs, name=self.name, dtype=self.array.dtype.str,
                      shape=list(self.array.shape))
        return (_dumps(header).encode() + b"\n"
                + np.ascontiguousarray(self.array).tobytes())

    @classmethod
    def decode(cls, payload: bytes) -> Dump:
        header_end = payload.index(b"\n")
        header = json.loads(payload[:header_end])
        name = header.pop("name")
        dtype = np.dtype(header.pop("dtype"))
        shape = header.pop("shape")
        array = np.frombuffer(payload[header_end + 1 :], dtype=dtype).reshape(shape)
        return cls(name, array, header)

    @property
    def kept_position(self) -> tuple[int, int] | None:
        """(step, index) if this answers a dump request."""
        if not self.name.startswith(KEPT_PREFIX):
            return None
        return int(self.attrs["step"]), int(self.attrs["index"])


def kept_name(step: int, index: int, output: int) -> str:
    return f"{KEPT_PREFIX}{step}-{index}-out{output}"
