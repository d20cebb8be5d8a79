"""The capture reader: every file is checked before it is believed (Note [Damage detection]
in ``nondet/store/__init__.py``); whatever a file holds or declares, the result is a
``Capture`` or one NondetError line, never a crash, a hang or an unbounded read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from nondet import __version__
from nondet.errors import NondetError
from nondet.records import OP_DTYPE
from nondet.store import probe
from nondet.store.writer import (
    DIGEST_ATTR,
    FORMAT_MAJOR,
    SOURCE_TEXT_MARK,
    STRINGS_CRC_ATTR,
    TABLES,
    _h5py,
    attrs_digest,
    decode_attr,
    strings_crc,
)

# -- reading ------------------------------------------------------------------------------------
#: Deflate expands data at most ~1032:1, so a table cannot hold more rows than this many times
#: its stored bytes (plus slack for small tables): more is a crafted or damaged shape, refused
#: before anything is read (a 51 KiB file once declared 12 million rows).
_MAX_EXPANSION = 1100
_SLACK_BYTES = 1 << 20
_MAX_STRINGS = 1 << 24
#: And whatever the ratio, no single read is larger than this (a deflate bomb of a few MB
#: could otherwise declare gigabytes): tables read whole, one step's op records, one dump.
_MAX_READ_BYTES = 1 << 30
_OPS_CACHE_BYTES = 64 << 20  # op records kept in memory for reuse
_DUMP_KINDS = "biufc"  # numeric and bool dumps only


class Capture:
    """Reader of one capture: attributes, strings, steps and tensors in memory; op records
    read per step and dumps on first use, each checked (Note [Damage detection])."""

    def __init__(self, path: Path, file: Any, attrs: dict[str, Any], env: dict[str, str],
                 facts: dict[str, Any], strings: list[str], steps: np.ndarray,
                 tensors: np.ndarray, op_index: np.ndarray) -> None:
        self.path, self._file = path, file
        self.attrs, self.env, self.facts = attrs, env, facts
        self.strings, self.steps, self.tensors = strings, steps, tensors
        self._op_index = op_index
        self._ops_cache: dict[int, np.ndarray] = {}
        self._parts: dict[int, list[tuple[int, int]]] | None = None  # step -> (start, count)
        self._ops_ds: Any = None
        self.verified = False  # every record and dump has been read once, checksums held
        self._dumps: dict[str, tuple[np.ndarray, dict[str, Any]]] | None = None
        self._source_texts: dict[str, str] | None = None

    @property
    def label(self) -> str:
        return str(self.attrs.get("label", self.path.stem))

    @property
    def status(self) -> str:
        return str(self.attrs.get("status", "unknown"))

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
        with _reading(self.path, "/ops"):
            if self._ops_ds is None:  # kept open: its chunk cache serves neighbouring steps
                self._ops_ds = self._file["ops"]
            rows = [self._ops_ds[start : start + count] for start, count in parts]
        out = np.concatenate(rows) if rows else np.zeros(0, dtype=OP_DTYPE)
        _check_ops(self.path, out, step, len(self.strings))
        # Keep recent steps up to a byte budget: comparisons read each step more than once.
        while self._ops_cache and sum(v.nbytes for v in self._ops_cache.values()) \
                + out.nbytes > _OPS_CACHE_BYTES:
            self._ops_cache.pop(next(iter(self._ops_cache)))
        self._ops_cache[step] = out
        return out

    def op_count(self, step: int) -> int:
        """How many op records a step has, without reading them."""
        return int(self._op_index["count"][self._op_index["step"] == step].sum())

    def tensor_rows(self, step: int) -> np.ndarray:
        return self.tensors[self.tensors["step"] == step]

    def verify(self) -> None:
        """Read every op record and dump once, in bounded pieces, so that damage anywhere in
        the file is found (the checksums are checked as data is read): run before a verdict
        says "identical" or a table says "this is what the file holds"."""
        if self.verified:
            return
        step = 1 << 16  # rows per read: 4 MiB of op records
        with _reading(self.path, "/ops"):
            ds = self._file["ops"]
            for start in range(0, ds.shape[0], step):
                ds[start : start + step]
        with _reading(self.path, "/dumps"):
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
            with _reading(self.path, "/dumps"):
                self._dumps = {name: _read_dump(ds)
                               for name, ds in self._file["dumps"].items()}
        return self._dumps


class _Damaged(Exception):
    """Raised inside the reader; becomes one NondetError line."""


def open_capture(path: str | Path) -> Capture:
    """Open and check a capture, or raise NondetError with a one-line reason (exit 2).

    A file this process did not write is read completely in a child process first
    (``nondet.store.probe``): libhdf5 can crash or loop on a damaged file."""
    path = Path(path)
    if not path.exists():
        raise _error(f"capture not found: {path}")
    _refuse_special(path)
    probed = not probe.trusted(path) and probe.probe(path, _read_all)
    capture = _open(path)
    capture.verified = probed  # the child read all of it: no need to again
    return capture


def _read_all(path: Path) -> None:
    _open(path).verify()


def _open(path: Path) -> Capture:
    h5py = _h5py()
    try:
        f = h5py.File(path, "r")
    except (OSError, ValueError) as exc:
        raise _error(
            f"cannot read {path}: not an HDF5 file or truncated ({_first_line(exc)}); "
            "re-capture it with `nondet run`"
        ) from None
    try:
        return _load(path, f)
    except BaseException:
        f.close()
        raise


def _refuse_special(path: Path) -> None:
    """A FIFO would block the open, a device never ends: only regular files are read."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise _error(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        what = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device" if
                stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise _error(f"cannot read {path}: it is {what}, not a capture file")


class _reading:  # a context manager, named like one
    """Turns what libhdf5, h5py or NumPy raise on a damaged file into one NondetError line."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, NondetError):
            return
        if isinstance(exc, _Damaged):
            reason = str(exc)
        elif isinstance(exc, (OSError, ValueError, KeyError, TypeError, IndexError,
                              OverflowError, RuntimeError)):
            reason = f"{self.what}: {_first_line(exc)}"
            if "filter returned failure" in reason or "checksum" in reason:
                reason = f"{self.what}: checksum mismatch, the data was changed on disk"
        else:
            return
        raise _error(f"cannot read {self.path}: damaged capture ({reason}); "
                     "re-capture it with `nondet run`") from None


def _load(path: Path, f: Any) -> Capture:
    with _reading(path, "attributes"):
        has_version = "nondet_format_version" in f.attrs
        version = str(decode_attr(_attr_value(f, "nondet_format_version"))) if has_version else ""
    if not version:
        raise _error(f"{path} is an HDF5 file but not a nondet capture")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        raise _error(f"{path}: unreadable format version {version!r}") from None
    if major > FORMAT_MAJOR:
        raise _error(
            f"{path} was written in capture format {version}, newer than this "
            f"nondet ({__version__}) reads; upgrade nondet"
        )
    size = max(path.stat().st_size, 1)
    with _reading(path, "attributes"):
        groups = {name: _read_attrs(f, name) for name in ("", "env", "facts")}
        for name in ("env", "facts", "dumps"):
            if not isinstance(f.get(name), _h5py().Group):
                raise _Damaged(f"/{name} is missing or not a group")
        attrs = _typed_attrs(groups[""])
        digest = attrs.get(DIGEST_ATTR)
        if digest is not None and digest != attrs_digest(groups):
            raise _Damaged("attribute checksum mismatch")
        facts = _typed_facts(groups["facts"])
    with _reading(path, "/strings"):
        ds = _table(f, "strings", None, size)
        strings = [decode_attr(s) if isinstance(s, bytes) else str(s) for s in ds[()]]
        crc = attrs.get(STRINGS_CRC_ATTR)
        if crc is not None and crc != strings_crc(strings):
            raise _Damaged("string table checksum mismatch")
    tables = {}
    for name in ("steps", "tensors", "op_index"):
        with _reading(path, f"/{name}"):
            tables[name] = np.asarray(_table(f, name, TABLES[name], size)[()],
                                      dtype=TABLES[name])
    with _reading(path, "/ops"):
        n_ops = _table(f, "ops", OP_DTYPE, size).shape[0]
        _check_index(tables["op_index"], tables["steps"], n_ops)
    with _reading(path, "/dumps"):
        for ds in f["dumps"].values():
            _check_dump(ds)
    return Capture(path=path, file=f, attrs=attrs,
                   env={k: str(v) for k, v in groups["env"].items()}, facts=facts,
                   strings=strings, steps=tables["steps"], tensors=tables["tensors"],
                   op_index=tables["op_index"])


def _attr_value(obj: Any, key: str) -> Any:
    """One attribute, refused unless it is a single value (never an array of any size)."""
    if obj.attrs.get_id(key).shape not in ((), None):
        raise _Damaged(f"attribute {key!r} is an array")
    return obj.attrs[key]


def _read_attrs(f: Any, group: str) -> dict[str, Any]:
    obj = f[group] if group else f
    names = list(obj.attrs.keys())
    if len(names) > 100_000:
        raise _Damaged(f"{len(names)} attributes on /{group}")
    return {key: decode_attr(_attr_value(obj, key)) for key in names}


_INT_ATTRS = ("exit_code", "steps", "seed", "rank", "world_size", DIGEST_ATTR,
              STRINGS_CRC_ATTR)


def _typed_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    for key in _INT_ATTRS:
        if key in attrs and (not isinstance(attrs[key], int) or isinstance(attrs[key], bool)):
            raise _Damaged(f"attribute {key!r} is not an integer")
    for key, value in attrs.items():
        if key not in _INT_ATTRS and not isinstance(value, (str, int, float)):
            raise _Damaged(f"attribute {key!r} has an unexpected type")
    op_steps = attrs.get("op_steps", "all")
    if op_steps != "all":
        parsed = json.loads(op_steps) if isinstance(op_steps, str) else None
        if not isinstance(parsed, list) or not all(type(s) is int for s in parsed):
            raise _Damaged("attribute 'op_steps' is not a list of steps")
    return attrs


def _typed_facts(raw: dict[str, Any]) -> dict[str, Any]:
    facts = {key: json.loads(value) for key, value in raw.items()}
    for key, value in facts.items():
        if key.startswith("dataloader#") and not isinstance(value, dict):
            raise _Damaged(f"fact {key!r} is not a table")
        if key in ("numpy.unseeded_generator", "python.unseeded_random",
                   "library.unseeded_generator") and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise _Damaged(f"fact {key!r} is not a list of places")
    return facts


def _table(f: Any, name: str, dtype: np.dtype | None, file_size: int) -> Any:
    """A 1-d dataset of the expected row type whose declared size its stored bytes can hold."""
    h5py = _h5py()
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset):
        raise _Damaged(f"/{name} is missing or not a table")
    if dtype is None:
        if h5py.check_string_dtype(ds.dtype) is None:
            raise _Damaged(f"/{name} is not a string table")
    elif ds.dtype != dtype:
        raise _Damaged(f"/{name} has rows of an unexpected type")
    if len(ds.shape) != 1:
        raise _Damaged(f"/{name} is not one-dimensional")
    rows = int(ds.shape[0])
    stored = int(ds.id.get_storage_size())
    item = 16 if dtype is None else dtype.itemsize  # a string is a 16-byte heap reference
    if stored > file_size or rows * item > _MAX_EXPANSION * stored + _SLACK_BYTES \
            or (dtype is None and rows > _MAX_STRINGS):
        raise _Damaged(f"/{name} declares {rows:,} rows but the file holds {stored:,} bytes "
                       "of them")
    if name != "ops" and rows * item > _MAX_READ_BYTES:  # /ops is read per step
        raise _Damaged(f"/{name} declares {rows:,} rows, more than nondet reads at once")
    return ds


def _check_index(index: np.ndarray, steps: np.ndarray, n_ops: int) -> None:
    start, count = index["start"], index["count"]
    if ((start < 0) | (count < 0) | (start > n_ops) | (count > n_ops - start)).any():
        raise _Damaged("/op_index points outside /ops")
    if (steps["step"] < -1).any() or (index["step"] < -1).any():
        raise _Damaged("a step number is below -1")
    if len(index):
        _, which = np.unique(index["step"], return_inverse=True)
        per_step = np.bincount(which, weights=count.astype(np.float64))
        if per_step.max() * OP_DTYPE.itemsize > _MAX_READ_BYTES:
            raise _Damaged("a step declares more op records than nondet reads at once")


def _check_ops(path: Path, ops: np.ndarray, step: int, n_strings: int) -> None:
    """Op records whose fields the comparison and the tables interpret: the step, the enums,
    and string ids (a name always; module and source may be -1, "none")."""
    from nondet.records import Kind, Phase

    bad = ((ops["step"] != step) | (ops["kind"] > max(Kind)) | (ops["phase"] > max(Phase))
           | (ops["name"] < 0) | (ops["name"] >= n_strings)
           | (ops["module"] < -1) | (ops["module"] >= n_strings)
           | (ops["source"] < -1) | (ops["source"] >= n_strings))
    if bad.any():
        raise _error(f"cannot read {path}: damaged capture (/ops: record "
                          f"{int(np.argmax(bad))} of step {step} is malformed); re-capture "
                          "it with `nondet run`")


def _check_dump(ds: Any) -> None:
    """A dump's type, declared size and attributes, checked without reading its values."""
    if not isinstance(ds, _h5py().Dataset) or ds.dtype.kind not in _DUMP_KINDS:
        raise _Damaged("a dump is not a numeric array")
    declared = float(np.prod(ds.shape, dtype=np.float64)) * ds.dtype.itemsize
    if declared > min(_MAX_EXPANSION * int(ds.id.get_storage_size()) + _SLACK_BYTES,
                      _MAX_READ_BYTES):
        raise _Damaged("a dump declares more values than the file holds")
    for key in ds.attrs:
        value = decode_attr(_attr_value(ds, key))
        if key in ("step", "index") and type(value) is not int:
            raise _Damaged(f"a dump's {key!r} is not an integer")


def _read_dump(ds: Any) -> tuple[np.ndarray, dict[str, Any]]:
    _check_dump(ds)
    return np.asarray(ds[()]), {k: decode_attr(ds.attrs[k]) for k in ds.attrs}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _error(message: str) -> NondetError:
    """The one line shown for a bad file: its name and any text from inside it are shown
    with control characters replaced, so a crafted file cannot drive the terminal."""
    return NondetError(_CONTROL.sub("\ufffd", message))


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
