"""The pipe between a captured run (child) and nondet (parent).

The child never writes the HDF5 file itself: it streams framed messages and the parent
writes them. A child that crashes or is killed therefore cannot corrupt its capture; the
parent closes the file, marked incomplete, with everything up to the last whole message.

Frame: 1 byte type, 4 bytes little-endian length, payload. JSON payloads for metadata,
raw NumPy bytes (dtypes in ``records``) for rows.
"""

from __future__ import annotations

import json
import os
import select
import struct
from collections.abc import Callable
from typing import Any, BinaryIO

META = b"M"  # JSON: root attributes and environment entries (may repeat; later keys win)
STRINGS = b"S"  # JSON list of new strings, ids continue from the previous message
STEP = b"P"  # one STEP_DTYPE row
TENSORS = b"T"  # TENSOR_DTYPE rows
OPS = b"O"  # OP_DTYPE rows of one step
FACTS = b"F"  # JSON: facts the recipe matcher uses (loader settings, unseeded RNGs, ...)
DUMP = b"D"  # JSON header line, then raw array bytes
END = b"E"  # JSON: {"status": complete|stopped|failed|interrupted, ...}

# Parent -> child on the control pipe (one word per line):
STOP = b"stop\n"  # stop at the next step boundary
GO = b"go\n"  # lockstep: run one more step, then wait again
FREE = b"free\n"  # lockstep: stop waiting at step boundaries (the other run has ended)
DUMP_REQUEST = b"dump"  # lockstep: "dump STEP INDEX\n": send that record's kept outputs

_HEADER = struct.Struct("<cI")


class FrameWriter:
    """Child side. Buffered; ``flush`` at step ends and before exiting."""

    def __init__(self, fd: int) -> None:
        self._file: BinaryIO = os.fdopen(fd, "wb", buffering=1 << 16)

    def send(self, kind: bytes, payload: bytes) -> None:
        self._file.write(_HEADER.pack(kind, len(payload)))
        self._file.write(payload)

    def send_json(self, kind: bytes, obj: Any) -> None:
        self.send(kind, json.dumps(obj, default=str).encode())

    def flush(self) -> None:
        try:
            self._file.flush()
        except (BrokenPipeError, OSError):
            pass  # the parent is gone; nothing left to tell it


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


def stop_requested(fd: int) -> bool:
    """Child side: has the parent asked us to stop? Never blocks."""
    try:
        ready, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError):
        return False
    if not ready:
        return False
    try:
        return STOP in os.read(fd, 256)
    except OSError:
        return False


def wait_for_turn(fd: int, on_dump: Callable[[int, int], None]) -> bytes:
    """Child side, lockstep: block until the parent says GO, FREE or STOP (STOP wins);
    answer DUMP requests (``on_dump(step, index)``) while waiting.

    A closed pipe (the parent is gone) counts as FREE: the run finishes on its own.
    """
    pending = b""
    while True:
        try:
            data = os.read(fd, 256)
        except OSError:
            return FREE
        if not data:
            return FREE
        pending += data
        *lines, pending = pending.split(b"\n")
        words = [line.split() for line in lines if line.strip()]
        for word in words:
            if word[0] == DUMP_REQUEST and len(word) == 3:
                on_dump(int(word[1]), int(word[2]))
        kinds = {w[0] + b"\n" for w in words}
        for answer in (STOP, FREE, GO):
            if answer in kinds:
                return answer


def dump_request(step: int, index: int) -> bytes:
    return DUMP_REQUEST + f" {step} {index}\n".encode()


# META keys (JSON objects sent with META; later keys win)
ENV = "env"  # environment entries: versions, devices, switches
HOOK_ERROR = "hook_error"  # traceback of an exception inside nondet's hooks (a nondet bug)
DUMP_DONE = "dump_done"  # [step, index, count]: the kept outputs asked for have been sent
