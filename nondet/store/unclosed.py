"""Reading a capture whose writer was killed before it closed the file.

Note [Unclosed captures]
The writer (``store/writer.py``, in nondet's own process) flushes the file with every
batch of rows it stores (at most a quarter second apart while a run sends any: Note [Rows
stored in batches]), so what a SIGKILLed nondet leaves behind (``kill -9``, a CI job's
timeout, the OOM killer) is consistent up to its last flush. HDF5 still refuses to open
it: the 1.10 superblock keeps "open for writing" flags that only a clean close resets
(``h5clear -s`` resets them by writing the file). nondet never writes a capture it reads:
HDF5 reads this one through a file object whose first bytes are the superblock with those
flags cleared and its checksum (Jenkins' lookup3, as HDF5 computes it) recomputed; every
other byte is the file's. This is tried only after HDF5 could take the file's lock, so no
process is still writing it (a live writer holds the lock: "unable to lock file").
Whatever the flush left is then checked like any capture (Note [Damage detection]); the
run's status attribute, never written by the killed writer, says the run did not finish.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_MASK = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle`` of ``data`` (HDF5's metadata checksum)."""
    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & _MASK
    i = 0
    while n - i > 12:
        a = (a + int.from_bytes(data[i:i + 4], "little")) & _MASK
        b = (b + int.from_bytes(data[i + 4:i + 8], "little")) & _MASK
        c = (c + int.from_bytes(data[i + 8:i + 12], "little")) & _MASK
        for r1, r2, r3 in ((4, 6, 8), (16, 19, 4)):  # lookup3's mix(), in two halves
            a = (a - c) & _MASK ^ _rot(c, r1)
            c = (c + b) & _MASK
            b = (b - a) & _MASK ^ _rot(a, r2)
            a = (a + c) & _MASK
            c = (c - b) & _MASK ^ _rot(b, r3)
            b = (b + a) & _MASK
        i += 12
    if i == n:
        return c
    tail = data[i:] + bytes(12 - (n - i))
    a = (a + int.from_bytes(tail[0:4], "little")) & _MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & _MASK
    c = (c + int.from_bytes(tail[8:12], "little")) & _MASK
    c = (c ^ b) - _rot(b, 14) & _MASK
    a = (a ^ c) - _rot(c, 11) & _MASK
    b = (b ^ a) - _rot(a, 25) & _MASK
    c = (c ^ b) - _rot(b, 16) & _MASK
    a = (a ^ c) - _rot(c, 4) & _MASK
    b = (b ^ a) - _rot(a, 14) & _MASK
    c = (c ^ b) - _rot(b, 24) & _MASK
    return c


def closed_superblock(head: bytes) -> bytes | None:
    """The superblock at the start of ``head`` with its open-for-writing flags cleared and
    its checksum recomputed, or None: not a version 2 or 3 superblock at offset 0 (what
    nondet's writer makes), or one whose checksum does not match (damage: left to HDF5)."""
    if len(head) < 12 or not head.startswith(_SIGNATURE) or head[8] not in (2, 3):
        return None
    offsets = head[9]
    if offsets not in (2, 4, 8):
        return None
    end = 12 + 4 * offsets  # signature .. flags, then four addresses
    if len(head) < end + 4:
        return None
    if lookup3(head[:end]) != int.from_bytes(head[end:end + 4], "little"):
        return None
    fixed = head[:11] + b"\x00" + head[12:end]
    return fixed + lookup3(fixed).to_bytes(4, "little")


def marked_open(path: Path) -> bool:
    """Whether ``path`` starts with a version 2 or 3 superblock whose open-for-writing flags
    are set: its writer is still going, or was killed (no HDF5 call: read before any)."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except OSError:
        return False
    return len(head) == 12 and head.startswith(_SIGNATURE) and head[8] in (2, 3) \
        and head[11] != 0


class OverlaidFile(io.RawIOBase):
    """A read-only file object over ``path`` whose first bytes read as ``head``."""

    def __init__(self, path: Path, head: bytes) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY)
        self._head = head
        self._pos = 0
        self._size = os.fstat(self._fd).st_size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = os.pread(self._fd, len(view), self._pos)
        if self._pos < len(self._head) and data:
            start = self._pos
            cut = min(len(data), len(self._head) - start)
            data = self._head[start:start + cut] + data[cut:]
        view[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def open_unclosed(path: Path) -> Any | None:
    """``path`` opened read-only by h5py as if its writer had closed it (Note [Unclosed
    captures]), or None where its superblock is not one this can clear."""
    import h5py

    with open(path, "rb") as f:
        head = closed_superblock(f.read(64))
    if head is None:
        return None
    raw = OverlaidFile(path, head)
    try:
        return h5py.File(raw, "r")
    except (OSError, ValueError):
        raw.close()
        return None
