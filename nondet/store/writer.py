"""The capture writer (parent side) and the format helpers the reader shares."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from nondet import __version__
from nondet.printable import as_utf8
from nondet.records import COMM_DTYPE, INDEX_DTYPE, OP_DTYPE, STEP_DTYPE, TENSOR_DTYPE
from nondet.store import probe

FORMAT_VERSION = "1.1"
FORMAT_MAJOR = 1

#: Tables and their row layouts (the reader checks a file against these).
TABLES: dict[str, np.dtype] = {"steps": STEP_DTYPE, "tensors": TENSOR_DTYPE, "ops": OP_DTYPE,
                               "op_index": INDEX_DTYPE, "comm": COMM_DTYPE}
#: Tables a file written by an older nondet may lack (read as empty).
OPTIONAL_TABLES = ("comm",)
DIGEST_ATTR = "nondet_digest"
STRINGS_CRC_ATTR = "nondet_strings_crc"
#: Root attribute: nondet ended the run after this many idle seconds (``nondet.idle``).
IDLE_ENDED = "idle_ended"

# h5py serializes calls through one global lock anyway; this keeps our own multi-step
# updates (resize + write) atomic when two runs are captured at once.
_H5_LOCK = threading.Lock()


def _h5py() -> Any:
    import h5py

    return h5py


class CaptureWriter:
    """Parent side: receives a run's messages and appends them to its HDF5 file.

    Note [Rows stored in batches]
    Storing a step row (an HDF5 append, the step count attribute, a flush) costs 0.3 ms of
    CPU on an idle machine and about 1 ms while the run trains on both cores, where it
    takes that time from the run: a 15 ms step measured 1.2x under step-level capture, a
    quarter of it this process's work per row. With ``store_every`` > 0 the rows of every
    table wait in memory and are stored together, with one flush, once the oldest stored
    batch is ``store_every`` seconds old (``add_step``), or when the stream asks between
    reads (``store_due``: rows that arrived before a long quiet step are stored within
    moments), and before anything else flushes or the file closes. The run's own process
    holds nothing back: a crash of the run loses no row (this process has them all). What
    a SIGKILLed nondet leaves is consistent up to its last store, at most ``store_every``
    seconds behind the run (Note [Unclosed captures]), and never more than
    ``MAX_PENDING_BYTES`` of rows wait. 0: every step row is stored and
    flushed as it comes (tests and tools writing captures directly).
    """

    #: Rows waiting are stored once they are this large, whatever their age: a run stopped
    #: for a full disk stores them at its close, within stream.RESERVE_BYTES.
    MAX_PENDING_BYTES = 256 * 1024

    def __init__(self, path: Path, attrs: dict[str, Any], store_every: float = 0.0) -> None:
        h5py = _h5py()
        self.path = path
        self.store_every = store_every
        #: rows waiting to be stored, by table, in arrival order (Note [Rows stored in batches])
        self._pending: dict[str, list[np.ndarray]] = {}
        self._pending_bytes = 0
        self._rows: dict[str, int] = dict.fromkeys(TABLES, 0)  # stored and waiting, by table
        self._stored_at = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        # The 1.10 object format: checksummed metadata (Note [Damage detection]).
        # Note [HDF5_DRIVER]: the HDF5 library takes its default file driver from the
        # environment variable HDF5_DRIVER, meant for the user's own files (the script
        # keeps it): with "family" nondet wrote run-a-000000.h5 and exited 3, with an
        # unknown name HDF5 crashed it; a capture is one plain POSIX file.
        self._file = h5py.File(path, "w", libver=("v110", "v110"), driver="sec2")
        # Set before the first close attempt: a close that failed half-way (a write refused:
        # RLIMIT_FSIZE) leaves the id "valid", and touching that file again crashes HDF5.
        self._closing = False
        self._fd = self._file.id.get_vfd_handle()  # read while the file is sound
        try:
            with self._writing():
                self._create(attrs)
        except RuntimeError as exc:  # h5py's words for a refused write (EFBIG at the flush)
            if not hdf5_write_failed(exc):
                raise
            raise OSError(str(exc)) from None

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """One update of the file; a write HDF5 reports refused gives the file up at once
        (see ``_discard_writes``), before anything else touches it."""
        with _H5_LOCK:
            try:
                yield
            except (OSError, RuntimeError) as exc:
                if hdf5_write_failed(exc):
                    self._discard_writes()
                raise

    def _create(self, attrs: dict[str, Any]) -> None:
        h5py = _h5py()
        f = self._file
        self._strings_crc = self._stored_crc = 0
        self._entry_hashes: dict[tuple[str, str], int] = {}  # (group, key) -> entry_hash
        f.create_group("env")
        f.create_group("facts")
        f.create_group("dumps")
        # The tables stay open until the file closes: a dataset's close writes its cached
        # chunks, and a close that fails there (a dataset object freed while the disk
        # refuses writes) happens where no exception reaches nondet, and crashes HDF5 later.
        self._tables: dict[str, Any] = {"strings": f.create_dataset(
            "strings", shape=(0,), maxshape=(None,), dtype=h5py.string_dtype(), chunks=(1024,)
        )}
        for name, chunk in (("steps", 256), ("tensors", 1024), ("ops", 8192),
                            ("op_index", 256), ("comm", 256)):
            self._tables[name] = f.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=TABLES[name], chunks=(chunk,),
                compression="gzip", compression_opts=1, shuffle=True, fletcher32=True,
            )
        self._set("", {"nondet_format_version": FORMAT_VERSION, "nondet_version": __version__,
                       "status": "running", STRINGS_CRC_ATTR: 0, **attrs})
        f.flush()
        self.n_steps = 0

    def _set(self, group: str, attrs: dict[str, Any]) -> None:
        """Write attributes and refresh the digest over every attribute value."""
        target = self._file[group] if group else self._file
        before = self._digest()
        for key, value in attrs.items():
            stored = value if group == "facts" else _attr(value)
            target.attrs[key] = stored
            # Hash what a reader will decode: read back unless it is a plain value that
            # h5py returns unchanged (the common case, and this runs at every step).
            if type(stored) not in (int, float, str):
                stored = decode_attr(target.attrs[key])
            if isinstance(stored, str):
                self._entry_hashes[group, key] = entry_hash(group, key, stored)
            else:  # numbers live in the checksummed object header itself
                self._entry_hashes.pop((group, key), None)
        if self._digest() != before or DIGEST_ATTR not in self._file.attrs:
            self._file.attrs[DIGEST_ATTR] = self._digest()  # an attribute write costs ~0.3 ms

    def _digest(self) -> int:
        return sum(self._entry_hashes.values()) % _DIGEST_MOD

    def add_env(self, env: dict[str, Any]) -> None:
        with self._writing():
            self._set("env", env)

    def set_op_steps(self, steps: list[int]) -> None:
        """The steps the run records ops at, when it says they differ from its plan."""
        with self._writing():
            self._set("", {"op_steps": [int(s) for s in steps]})

    def add_facts(self, facts: dict[str, Any]) -> None:
        with self._writing():
            self._set("facts", {key: json.dumps(value) for key, value in facts.items()})

    def add_strings(self, strings: list[str]) -> None:
        with self._writing():
            strings = [as_utf8(text) for text in strings]  # Note [Text from the program]
            _append(self._tables["strings"], np.array(strings, dtype=object))
            # Stored with the next step or at close (where the file is flushed).
            self._strings_crc = strings_crc(strings, self._strings_crc)

    def add_step(self, row: np.ndarray) -> None:
        with self._writing():
            # counted first: a store the queue makes (its byte cap) writes the count with it
            self.n_steps += int((row["step"] >= 0).sum())
            self._queue("steps", row)
            if time.monotonic() - self._stored_at >= self.store_every and not self._closing:
                self._store()

    def store_due(self) -> None:
        """Store the rows that wait, if the last store is ``store_every`` seconds old."""
        if self._pending and time.monotonic() - self._stored_at >= self.store_every:
            with self._writing():
                if not self._closing:  # closed meanwhile: what waited was stored then
                    self._store()

    def _queue(self, table: str, rows: np.ndarray) -> None:
        # a copy: the caller's array may be a view of a buffer it reuses
        self._pending.setdefault(table, []).append(np.array(rows, dtype=TABLES[table]))
        self._rows[table] += len(rows)
        self._pending_bytes += rows.nbytes
        if self._pending_bytes >= self.MAX_PENDING_BYTES and not self._closing:
            self._store()

    def _store(self) -> None:
        """Append every waiting row, then the step count and strings checksum, and flush:
        the file on disk is always a whole prefix of what the run sent."""
        pending, self._pending, self._pending_bytes = self._pending, {}, 0
        for table, parts in pending.items():
            _append(self._tables[table], parts[0] if len(parts) == 1 else np.concatenate(parts))
        changed = {STRINGS_CRC_ATTR: self._strings_crc} \
            if self._strings_crc != self._stored_crc else {}
        self._stored_crc = self._strings_crc
        self._set("", {"steps": self.n_steps, **changed})
        self._file.flush()
        self._stored_at = time.monotonic()

    def add_tensors(self, rows: np.ndarray) -> None:
        with self._writing():
            self._queue("tensors", rows)

    def add_ops(self, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        with self._writing():
            start = self._rows["ops"]
            self._queue("ops", rows)
            index = np.zeros(1, dtype=INDEX_DTYPE)
            index["step"], index["start"], index["count"] = rows["step"][0], start, len(rows)
            self._queue("op_index", index)

    def add_comm(self, rows: np.ndarray) -> None:
        if len(rows):
            with self._writing():
                self._queue("comm", rows)

    def add_dump(self, name: str, array: np.ndarray, attrs: dict[str, Any]) -> None:
        with self._writing():
            # HDF5 filters need a chunked layout, which a 0-d array cannot have.
            checked = {"fletcher32": True} if array.ndim else {}
            ds = self._file["dumps"].create_dataset(name, data=array, **checked)
            for key, value in attrs.items():
                ds.attrs[key] = _attr(value)
            self._store()  # flushed while ``ds`` is open (see ``_tables``), with the rows

    def close(self, status: str, exit_code: int | None,
              attrs: dict[str, Any] | None = None) -> None:
        """Store what waits, write how the run ended (``attrs``: more root attributes, such
        as ``idle_ended``) and close the file."""
        with _H5_LOCK:
            if self._closing or not self._file.id.valid:
                return
            self._closing = True
            try:
                self._store()
                self._set("", {**(attrs or {}), "status": status,
                               "exit_code": -1 if exit_code is None else exit_code,
                               STRINGS_CRC_ATTR: self._strings_crc})
                self._file.flush()  # a refused write shows here, before the close
            except (OSError, RuntimeError) as exc:
                if hdf5_write_failed(exc):
                    self._discard_writes()
                raise
            self._file.close()
            probe.remember_written(self.path)  # trusted by this process's reader

    def _discard_writes(self) -> None:
        # Once a write was refused (RLIMIT_FSIZE: EFBIG, an I/O error) HDF5 keeps the dirty
        # metadata and retries it at every later flush and close, and at interpreter exit,
        # where a retry after a failed close crashes the process (exit 139 instead of
        # nondet's exit 2). The file is lost past its last good flush anyway: HDF5's
        # descriptor now points at /dev/null, so the retries succeed into nothing and the
        # close completes. Never a second close after a failed one (that crashes too).
        self._closing = True
        if not self._file.id.valid:
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._fd)
        finally:
            os.close(null)
        try:
            self._file.close()
        except (OSError, RuntimeError):
            pass  # nothing left to save; the descriptor no longer reaches the file


def hdf5_write_failed(exc: BaseException) -> bool:
    """The system refused a write (file too large, disk full, I/O error). h5py reports one
    at flush or close as a RuntimeError (or an OSError) in several wordings ("file write
    failed: ...", "unable to extend file properly, errno = 27"): HDF5 names the errno."""
    if isinstance(exc, OSError) and exc.errno in _REFUSED:
        return True
    text = str(exc)
    return "write failed" in text or re.search(r"\berrno = \d+", text) is not None


_REFUSED = {errno.EFBIG, errno.ENOSPC, errno.EIO, errno.EDQUOT}


def _append(ds: Any, rows: np.ndarray) -> None:
    n = ds.shape[0]
    ds.resize((n + len(rows),))
    ds[n:] = rows


def _attr(value: Any) -> Any:
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    if value is None:
        return ""
    if isinstance(value, str):
        return as_utf8(value)  # Note [Text from the program]
    return value


def decode_attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def strings_crc(strings: Iterable[str], crc: int = 0) -> int:
    """Running CRC-32 of the string table (Note [Damage detection])."""
    for text in strings:
        crc = zlib.crc32(text.encode("utf-8", errors="surrogatepass") + b"\0", crc)
    return crc


_DIGEST_MOD = 1 << 63


def entry_hash(group: str, key: str, value: Any) -> int:
    h = hashlib.blake2b(json.dumps([group, key, value], default=repr).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def attrs_digest(groups: dict[str, dict[str, Any]]) -> int:
    """A 63-bit digest of every string attribute (root, /env, /facts): their values live in
    HDF5's unchecksummed global heap, numbers in the checksummed object header. A sum of
    one hash per attribute, so the writer updates it in O(1) per change."""
    total = sum(entry_hash(group, key, value) for group in ("", "env", "facts")
                for key, value in groups.get(group, {}).items() if isinstance(value, str))
    return total % _DIGEST_MOD
