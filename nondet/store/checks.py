"""What a capture file must satisfy before the reader believes it (Note [Damage detection]
in ``nondet/store/__init__.py``): sizes it can hold, row types, string ids, attribute types.
Every refusal is one NondetError line naming the file, never a crash or an unbounded read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from nondet.errors import NondetError
from nondet.records import OP_DTYPE
from nondet.store.writer import DIGEST_ATTR, STRINGS_CRC_ATTR, _h5py, decode_attr

#: Deflate expands data at most ~1032:1, so a table cannot hold more rows than this many times
#: its stored bytes (plus slack for small tables): more is a crafted or damaged shape, refused
#: before anything is read (a 51 KiB file once declared 12 million rows).
MAX_EXPANSION = 1100
SLACK_BYTES = 1 << 20
MAX_STRINGS = 1 << 24
#: And whatever the ratio, no single read is larger than this (a deflate bomb of a few MB
#: could otherwise declare gigabytes): tables read whole, one step's op records, one dump.
MAX_READ_BYTES = 1 << 30
DUMP_KINDS = "biufc"  # numeric and bool dumps only


class Damaged(Exception):
    """Raised inside the reader; becomes one NondetError line."""


def refuse_special(path: Path) -> None:
    """A FIFO would block the open, a device never ends: only regular files are read."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        what = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device" if
                stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise error(f"cannot read {path}: it is {what}, not a capture file")


class reading:  # a context manager, named like one
    """Turns what libhdf5, h5py or NumPy raise on a damaged file into one NondetError line."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, NondetError):
            return
        if isinstance(exc, Damaged):
            reason = str(exc)
        elif isinstance(exc, (OSError, ValueError, KeyError, TypeError, IndexError,
                              OverflowError, RuntimeError)):
            reason = f"{self.what}: {first_line(exc)}"
            if "filter returned failure" in reason or "checksum" in reason:
                reason = f"{self.what}: checksum mismatch, the data was changed on disk"
        else:
            return
        raise error(f"cannot read {self.path}: damaged capture ({reason}); "
                     "re-capture it with `nondet run`") from None


# Note [A capture reads no other file]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# HDF5 lets a file point elsewhere: an external link (an object in another HDF5 file), a
# dataset with external storage (its raw values are bytes of any file, at any offset) or a
# virtual dataset (a mapping onto datasets of other files). A crafted capture whose /steps
# kept its values in ~/.ssh/id_rsa had `nondet show` print that file's bytes as
# fingerprints and losses, and `diff --json/--html` write them into a report meant to be
# shared; pointed at a FIFO, a read blocks. nondet's writer makes none of these (hard
# links, chunked or contiguous data inside the file), so a file holding one is refused
# before anything is followed or read.

#: What a capture holds at its root: nothing else is read.
ROOT_OBJECTS = ("strings", "steps", "tensors", "ops", "op_index", "comm", "env", "facts",
                "dumps")


def check_self_contained(f: Any) -> None:
    """Everything nondet reads is stored in this file, checked before anything is followed
    or read (Note [A capture reads no other file]): the root's objects and each dump are hard
    links, and no dataset keeps its values in another file."""
    h5py = _h5py()
    dumps = _hard_link(f, "dumps", h5py)
    for name in ROOT_OBJECTS:
        _hard_link(f, name, h5py)
    if not isinstance(dumps, h5py.Group):
        return  # said as "missing or not a group" by the reader
    if len(dumps) > 1_000_000:
        raise Damaged(f"/dumps holds {len(dumps):,} objects")
    for name in dumps:
        _hard_link(dumps, name, h5py)
    for name in ROOT_OBJECTS:
        _stored_here(f.get(name), f"/{name}", h5py)
    for name in dumps:
        _stored_here(dumps.get(name), f"/dumps/{name}", h5py)


def _hard_link(group: Any, name: str, h5py: Any) -> Any:
    link = group.get(name, getlink=True)
    if link is not None and not isinstance(link, h5py.HardLink):
        raise Damaged(f"{group.name.rstrip('/')}/{name} is a link to somewhere else, which "
                      "nondet never writes")
    return group.get(name) if link is not None else None


def _stored_here(obj: Any, where: str, h5py: Any) -> None:
    if not isinstance(obj, h5py.Dataset):
        return
    plist = obj.id.get_create_plist()
    if plist.get_layout() == h5py.h5d.VIRTUAL or plist.get_external_count() > 0:
        raise Damaged(f"{where} keeps its values in another file, which nondet never writes")


def attr_value(obj: Any, key: str) -> Any:
    """One attribute, refused unless it is a single value (never an array of any size)."""
    if obj.attrs.get_id(key).shape not in ((), None):
        raise Damaged(f"attribute {key!r} is an array")
    return obj.attrs[key]


def read_attrs(f: Any, group: str) -> dict[str, Any]:
    obj = f[group] if group else f
    names = list(obj.attrs.keys())
    if len(names) > 100_000:
        raise Damaged(f"{len(names)} attributes on /{group}")
    return {key: decode_attr(attr_value(obj, key)) for key in names}


INT_ATTRS = ("exit_code", "steps", "seed", "rank", "world_size", DIGEST_ATTR,
              STRINGS_CRC_ATTR)


def typed_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    for key in INT_ATTRS:
        if key in attrs and (not isinstance(attrs[key], int) or isinstance(attrs[key], bool)):
            raise Damaged(f"attribute {key!r} is not an integer")
    for key, value in attrs.items():
        if key not in INT_ATTRS and not isinstance(value, (str, int, float)):
            raise Damaged(f"attribute {key!r} has an unexpected type")
    op_steps = attrs.get("op_steps", "all")
    if op_steps != "all":
        parsed = json.loads(op_steps) if isinstance(op_steps, str) else None
        if not isinstance(parsed, list) or not all(type(s) is int for s in parsed):
            raise Damaged("attribute 'op_steps' is not a list of steps")
    return attrs


def typed_facts(raw: dict[str, Any]) -> dict[str, Any]:
    facts = {key: json.loads(value) for key, value in raw.items()}
    for key, value in facts.items():
        if key.startswith("dataloader#") and not isinstance(value, dict):
            raise Damaged(f"fact {key!r} is not a table")
        if key in ("numpy.unseeded_generator", "python.unseeded_random",
                   "library.unseeded_generator") and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise Damaged(f"fact {key!r} is not a list of places")
    return facts


def table(f: Any, name: str, dtype: np.dtype | None, file_size: int) -> Any:
    """A 1-d dataset of the expected row type whose declared size its stored bytes can hold."""
    h5py = _h5py()
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset):
        raise Damaged(f"/{name} is missing or not a table")
    if dtype is None:
        if h5py.check_string_dtype(ds.dtype) is None:
            raise Damaged(f"/{name} is not a string table")
    elif ds.dtype != dtype:
        raise Damaged(f"/{name} has rows of an unexpected type")
    if len(ds.shape) != 1:
        raise Damaged(f"/{name} is not one-dimensional")
    rows = int(ds.shape[0])
    stored = int(ds.id.get_storage_size())
    item = 16 if dtype is None else dtype.itemsize  # a string is a 16-byte heap reference
    if stored > file_size or rows * item > MAX_EXPANSION * stored + SLACK_BYTES \
            or (dtype is None and rows > MAX_STRINGS):
        raise Damaged(f"/{name} declares {rows:,} rows but the file holds {stored:,} bytes "
                       "of them")
    if name != "ops" and rows * item > MAX_READ_BYTES:  # /ops is read per step
        raise Damaged(f"/{name} declares {rows:,} rows, more than nondet reads at once")
    return ds


def check_index(index: np.ndarray, steps: np.ndarray, n_ops: int) -> None:
    start, count = index["start"], index["count"]
    if ((start < 0) | (count < 0) | (start > n_ops) | (count > n_ops - start)).any():
        raise Damaged("/op_index points outside /ops")
    if (steps["step"] < -1).any() or (index["step"] < -1).any():
        raise Damaged("a step number is below -1")
    if (np.diff(steps["step"]) <= 0).any():
        # a run sends its steps once each, in order (from -1, before training): rows
        # numbered twice or out of order were compared by number and got a verdict
        raise Damaged("/steps: its step numbers are not increasing")
    if len(index):
        _, which = np.unique(index["step"], return_inverse=True)
        per_step = np.bincount(which, weights=count.astype(np.float64))
        if per_step.max() * OP_DTYPE.itemsize > MAX_READ_BYTES:
            raise Damaged("a step declares more op records than nondet reads at once")


def check_comm(rows: np.ndarray, n_strings: int) -> None:
    """Collective rows: a backend string id in range (or -1), known output states."""
    from nondet.records import CommOutput

    bad = ((rows["backend"] < -1) | (rows["backend"] >= n_strings) | (rows["step"] < -1)
           | (rows["index"] < 0) | (rows["output"] > max(CommOutput)))
    if bad.any():
        raise Damaged(f"/comm: row {int(np.argmax(bad))} is malformed")


def check_ops(path: Path, ops: np.ndarray, step: int, n_strings: int) -> None:
    """Op records whose fields the comparison and the tables interpret: the step, the enums,
    and string ids (a name always; module and source may be -1, "none")."""
    from nondet.records import Kind, Phase

    bad = ((ops["step"] != step) | (ops["kind"] > max(Kind)) | (ops["phase"] > max(Phase))
           | (ops["name"] < 0) | (ops["name"] >= n_strings)
           | (ops["module"] < -1) | (ops["module"] >= n_strings)
           | (ops["source"] < -1) | (ops["source"] >= n_strings))
    if bad.any():
        raise error(f"cannot read {path}: damaged capture (/ops: record "
                          f"{int(np.argmax(bad))} of step {step} is malformed); re-capture "
                          "it with `nondet run`")


def check_dump(ds: Any) -> None:
    """A dump's type, declared size and attributes, checked without reading its values."""
    if not isinstance(ds, _h5py().Dataset) or ds.dtype.kind not in DUMP_KINDS:
        raise Damaged("a dump is not a numeric array")
    declared = float(np.prod(ds.shape, dtype=np.float64)) * ds.dtype.itemsize
    if declared > min(MAX_EXPANSION * int(ds.id.get_storage_size()) + SLACK_BYTES,
                      MAX_READ_BYTES):
        raise Damaged("a dump declares more values than the file holds")
    for key in ds.attrs:
        value = decode_attr(attr_value(ds, key))
        if key in ("step", "index") and type(value) is not int:
            raise Damaged(f"a dump's {key!r} is not an integer")


def read_dump(ds: Any) -> tuple[np.ndarray, dict[str, Any]]:
    check_dump(ds)
    return np.asarray(ds[()]), {k: decode_attr(ds.attrs[k]) for k in ds.attrs}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def error(message: str) -> NondetError:
    """The one line shown for a bad file: its name and any text from inside it are shown
    with control characters replaced, so a crafted file cannot drive the terminal."""
    return NondetError(_CONTROL.sub("\ufffd", message))


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
