"""The capture reader: every file is checked before it is believed (``store.checks``;
Note [Damage detection] in ``nondet/store/__init__.py``); whatever a file holds or declares,
the result is a ``Capture`` or one NondetError line, never a crash, a hang or an unbounded
read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nondet import __version__
from nondet.outdir import named_like_invocation, writer_running
from nondet.records import COMM_DTYPE, OP_DTYPE, SOURCE_TEXT_MARK
from nondet.store import probe
from nondet.store.checks import (
    Damaged,
    attr_value,
    check_comm,
    check_dump,
    check_index,
    check_ops,
    check_self_contained,
    error,
    first_line,
    read_attrs,
    read_dump,
    reading,
    refuse_special,
    table,
    typed_attrs,
    typed_facts,
)
from nondet.store.unclosed import marked_open, open_unclosed
from nondet.store.writer import (
    DIGEST_ATTR,
    FORMAT_MAJOR,
    IDLE_ENDED,
    STRINGS_CRC_ATTR,
    TABLES,
    _h5py,
    attrs_digest,
    decode_attr,
    strings_crc,
)

_OPS_CACHE_BYTES = 64 << 20  # op records kept in memory for reuse


class Capture:
    """Reader of one capture: attributes, strings, steps and tensors in memory; op records
    read per step and dumps on first use, each checked (Note [Damage detection])."""

    def __init__(self, path: Path, file: Any, attrs: dict[str, Any], env: dict[str, str],
                 facts: dict[str, Any], strings: list[str], steps: np.ndarray,
                 tensors: np.ndarray, op_index: np.ndarray,
                 comm: np.ndarray | None = None) -> None:
        self.path, self._file = path, file
        #: one row per collective record (records.COMM_DTYPE; empty in older files)
        self.comm = comm if comm is not None else np.zeros(0, dtype=COMM_DTYPE)
        self.attrs, self.env, self.facts = attrs, env, facts
        self.strings, self.steps, self.tensors = strings, steps, tensors
        self._op_index = op_index
        self._ops_cache: dict[int, np.ndarray] = {}
        self._parts: dict[int, list[tuple[int, int]]] | None = None  # step -> (start, count)
        self._ops_ds: Any = None
        self.verified = False  # every record and dump has been read once, checksums held
        self._dumps: dict[str, tuple[np.ndarray, dict[str, Any]]] | None = None
        #: read as its writer's last flush left it (killed before closing the file)
        self.unclosed = False
        self._source_texts: dict[str, str] | None = None

    @property
    def label(self) -> str:
        return str(self.attrs.get("label", self.path.stem))

    @property
    def status(self) -> str:
        status = str(self.attrs.get("status", "unknown"))
        # a writer killed mid-run never wrote how the run ended (Note [Unclosed captures])
        return "interrupted" if self.unclosed and status == "running" else status

    @property
    def idle_ended(self) -> float:
        """> 0: nondet ended the run after this many seconds in which it sent nothing and
        used no CPU (``nondet.idle``); its status is then ``stopped``."""
        try:
            return float(self.attrs.get(IDLE_ENDED, 0.0))
        except (TypeError, ValueError):  # a capture is untrusted input
            return 0.0

    @property
    def complete(self) -> bool:
        """The run ended on its own or was stopped on purpose (not crashed or interrupted)."""
        return self.status in ("complete", "stopped")

    @property
    def exit_code(self) -> int:
        return int(self.attrs.get("exit_code", -1))

    @property
    def n_steps(self) -> int:
        return int((self.steps["step"] >= 0).sum())

    def string(self, sid: int) -> str:
        return self.strings[sid] if 0 <= sid < len(self.strings) else ""

    def source_text(self, source: str) -> str:
        """The text of a "file:line" source as the run captured it ("" if it did not)."""
        if self._source_texts is None:
            self._source_texts = {}
            for s in self.strings:
                if s.startswith(SOURCE_TEXT_MARK):
                    where, _, text = s[len(SOURCE_TEXT_MARK):].partition("\n")
                    self._source_texts.setdefault(where, text)
        return self._source_texts.get(source, "")

    def step_row(self, step: int) -> np.ndarray | None:
        hit = np.nonzero(self.steps["step"] == step)[0]
        return self.steps[hit[0]] if len(hit) else None

    def op_steps(self) -> list[int]:
        return sorted({int(s) for s in self._op_index["step"]})

    def ops(self, step: int) -> np.ndarray:
        """The op records of one step (read from the file now; a few steps are cached)."""
        cached = self._ops_cache.get(step)
        if cached is not None:
            return cached
        if self._parts is None:
            self._parts = {}
            for s, start, count in zip(self._op_index["step"].tolist(),
                                       self._op_index["start"].tolist(),
                                       self._op_index["count"].tolist(), strict=True):
                self._parts.setdefault(s, []).append((start, count))
        parts = self._parts.get(step, [])
        with reading(self.path, "/ops"):
            if self._ops_ds is None:  # kept open: its chunk cache serves neighbouring steps
                self._ops_ds = self._file["ops"]
            rows = [self._ops_ds[start : start + count] for start, count in parts]
        out = np.concatenate(rows) if rows else np.zeros(0, dtype=OP_DTYPE)
        check_ops(self.path, out, step, len(self.strings))
        # Keep recent steps up to a byte budget: comparisons read each step more than once.
        while self._ops_cache and sum(v.nbytes for v in self._ops_cache.values()) \
                + out.nbytes > _OPS_CACHE_BYTES:
            self._ops_cache.pop(next(iter(self._ops_cache)))
        self._ops_cache[step] = out
        return out

    def comm_row(self, step: int, index: int) -> np.void | None:
        """What was recorded of the collective at op record ``index`` of ``step``."""
        hit = np.nonzero((self.comm["step"] == step) & (self.comm["index"] == index))[0]
        return self.comm[hit[0]] if len(hit) else None

    def op_count(self, step: int) -> int:
        """How many op records a step has, without reading them."""
        return int(self._op_index["count"][self._op_index["step"] == step].sum())

    def tensor_rows(self, step: int) -> np.ndarray:
        rows: np.ndarray = self.tensors[self.tensors["step"] == step]
        return rows

    def verify(self) -> None:
        """Read every op record and dump once, in bounded pieces, so that damage anywhere in
        the file is found (the checksums are checked as data is read): run before a verdict
        says "identical" or a table says "this is what the file holds"."""
        if self.verified:
            return
        step = 1 << 16  # rows per read: 4 MiB of op records
        with reading(self.path, "/ops"):
            ds = self._file["ops"]
            for start in range(0, ds.shape[0], step):
                ds[start : start + step]
        with reading(self.path, "/dumps"):
            for dump in self._file["dumps"].values():
                if dump.chunks is None:
                    dump[()]
                    continue
                for piece in dump.iter_chunks():
                    dump[piece]
        self.verified = True

    @property
    def dumps(self) -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
        """Saved op outputs by name: (values, attributes)."""
        if self._dumps is None:
            with reading(self.path, "/dumps"):
                self._dumps = {name: read_dump(ds)
                               for name, ds in self._file["dumps"].items()}
        return self._dumps


def _not_found(path: Path) -> str:
    folder = path.parent
    if named_like_invocation(folder) and not folder.exists():
        # a run's capture whose invocation directory went while nondet ran: the script
        # removed .nondet (or --out), as a clean-up or a `rm -rf` of its outputs
        return (f"capture not found: {path}: the directory {folder} was deleted while "
                "nondet ran (by the script?); give --out a directory the script leaves alone")
    return f"capture not found: {path}"


def _refuse_report(path: Path) -> None:
    """A JSON report of nondet's given where a capture goes (``nondet show report.json``)
    was "not an HDF5 file or truncated ...; re-capture it": say what it is instead."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return  # the HDF5 open says why
    if not (head.lstrip().startswith(b"{") and b'"nondet_report_version"' in head):
        return
    try:
        runs = json.loads(path.read_text(encoding="utf-8")).get("runs") or []
        captures = [str(r["path"]) for r in runs if isinstance(r, dict) and "path" in r]
    except (OSError, ValueError, AttributeError, TypeError):
        captures = []
    named = ""
    if captures:
        gone = [c for c in captures if not Path(c).exists()]
        named = f"; the captures it names: {', '.join(captures[:2])}" + (
            " (not there now: moved or deleted)" if gone else "")
    raise error(f"{path} is a JSON report of nondet's, not a capture: `nondet report {path} "
                f"--html PATH` renders it again{named}")


def open_capture(path: str | Path) -> Capture:
    """Open and check a capture, or raise NondetError with a one-line reason (exit 2).

    A file this process did not write is read completely in a child process first
    (``nondet.store.probe``): libhdf5 can crash or loop on a damaged file."""
    path = Path(path)
    if not path.exists():
        raise error(_not_found(path))
    refuse_special(path)
    _refuse_report(path)
    if marked_open(path) and writer_running(path):
        # before the probe: with locking off, the superblock overlay read a file mid-write
        # and called it "damaged capture; re-capture it"
        raise error(_WRITING.format(path=path))
    probed = not probe.trusted(path) and probe.probe(path, _read_all)
    capture = _open(path)
    capture.verified = probed  # the child read all of it: no need to again
    return capture


def _read_all(path: Path) -> None:
    _open(path).verify()


def _open(path: Path) -> Capture:
    h5py = _h5py()
    unclosed = False
    try:
        f = h5py.File(path, "r", driver="sec2")  # Note [HDF5_DRIVER] in writer.py
    except (OSError, ValueError) as exc:
        # HDF5 took the lock, so no writer is left: read what its last flush left
        f = open_unclosed(path) if "already open for write" in str(exc) else None
        if f is None:
            raise error(_unopened(path, exc)) from None
        unclosed = True
    try:
        capture = _load(path, f)
    except BaseException:
        f.close()
        raise
    capture.unclosed = unclosed
    return capture


_WRITING = ("cannot read {path} yet: another process is writing it (a nondet run still going?); "
            "read it once that run has ended")


def _unopened(path: Path, exc: BaseException) -> str:
    """Why HDF5 would not open ``path``. A capture still being written, or left open by a
    nondet that was killed, is no damaged file: "re-capture it" was the wrong advice."""
    text = str(exc)
    if "unable to lock file" in text:
        return _WRITING.format(path=path)
    if "already open for write" in text:
        return (f"cannot read {path}: it is marked open for writing, by a nondet run still "
                "going or by one that was killed (SIGKILL, the out-of-memory killer) before it "
                f"could close it; in the second case `h5clear -s {path}` (HDF5's tools) clears "
                "the mark, or re-capture it with `nondet run`")
    return (f"cannot read {path}: not an HDF5 file or truncated ({first_line(exc)}); "
            "re-capture it with `nondet run`")


def _load(path: Path, f: Any) -> Capture:
    with reading(path, "attributes"):
        has_version = "nondet_format_version" in f.attrs
        version = str(decode_attr(attr_value(f, "nondet_format_version"))) if has_version else ""
    if not version:
        raise error(f"{path} is an HDF5 file but not a nondet capture")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        raise error(f"{path}: unreadable format version {version!r}") from None
    if major > FORMAT_MAJOR:
        raise error(
            f"{path} was written in capture format {version}, newer than this "
            f"nondet ({__version__}) reads; upgrade nondet"
        )
    size = max(path.stat().st_size, 1)
    with reading(path, "layout"):
        check_self_contained(f)  # before any link is followed or dataset read
    with reading(path, "attributes"):
        groups = {name: read_attrs(f, name) for name in ("", "env", "facts")}
        for name in ("env", "facts", "dumps"):
            if not isinstance(f.get(name), _h5py().Group):
                raise Damaged(f"/{name} is missing or not a group")
        attrs = typed_attrs(groups[""])
        digest = attrs.get(DIGEST_ATTR)
        if digest is not None and digest != attrs_digest(groups):
            raise Damaged("attribute checksum mismatch")
        facts = typed_facts(groups["facts"])
    with reading(path, "/strings"):
        ds = table(f, "strings", None, size)
        strings = [decode_attr(s) if isinstance(s, bytes) else str(s) for s in ds[()]]
        crc = attrs.get(STRINGS_CRC_ATTR)
        if crc is not None and crc != strings_crc(strings):
            raise Damaged("string table checksum mismatch")
    tables = {}
    for name in ("steps", "tensors", "op_index"):
        with reading(path, f"/{name}"):
            tables[name] = np.asarray(table(f, name, TABLES[name], size)[()],
                                      dtype=TABLES[name])
    comm = None
    if "comm" in f:  # written since format 1.1 files gained it; older files have none
        with reading(path, "/comm"):
            comm = np.asarray(table(f, "comm", COMM_DTYPE, size)[()], dtype=COMM_DTYPE)
            check_comm(comm, len(strings))
    with reading(path, "/ops"):
        n_ops = table(f, "ops", OP_DTYPE, size).shape[0]
        check_index(tables["op_index"], tables["steps"], n_ops)
    with reading(path, "/dumps"):
        for ds in f["dumps"].values():
            check_dump(ds)
    return Capture(path=path, file=f, attrs=attrs,
                   env={k: str(v) for k, v in groups["env"].items()}, facts=facts,
                   strings=strings, steps=tables["steps"], tensors=tables["tensors"],
                   op_index=tables["op_index"], comm=comm)
