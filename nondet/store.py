"""The HDF5 capture file: one per run, readable with plain h5py and h5ls.

Layout (format 1.x)::

    /                 attrs: nondet_format_version, nondet_version, label, command, script,
                      script_sha256, seed, started, rank, world_size, status, exit_code, steps
    /env              attrs: one string per environment key (versions, devices, threads, env vars)
    /facts            attrs: JSON values the recipe matcher uses
    /strings          utf-8 strings; op names, modules and sources are ids into it
    /steps            STEP_DTYPE rows, one per step (step -1 = state when training starts)
    /tensors          TENSOR_DTYPE rows: per-tensor fingerprints, for steps with op capture
    /ops              OP_DTYPE rows (64 bytes each), in execution order
    /op_index         INDEX_DTYPE rows: where each step's ops start in /ops
    /dumps/<name>     full values of one op's outputs (written only to measure a difference)

Everything is appended and flushed per step, so an interrupted run leaves a readable file
whose ``status`` attribute is not "complete".
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nondet import __version__
from nondet.errors import NondetError
from nondet.records import INDEX_DTYPE, OP_DTYPE, STEP_DTYPE, TENSOR_DTYPE

FORMAT_VERSION = "1.0"
FORMAT_MAJOR = 1

# h5py serializes calls through one global lock anyway; this keeps our own multi-step
# updates (resize + write) atomic when two runs are captured at once.
_H5_LOCK = threading.Lock()


def _h5py() -> Any:
    import h5py

    return h5py


class CaptureWriter:
    """Parent side: receives a run's messages and appends them to its HDF5 file."""

    def __init__(self, path: Path, attrs: dict[str, Any]) -> None:
        h5py = _h5py()
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = h5py.File(path, "w")
        f = self._file
        f.attrs["nondet_format_version"] = FORMAT_VERSION
        f.attrs["nondet_version"] = __version__
        f.attrs["status"] = "running"
        for key, value in attrs.items():
            f.attrs[key] = _attr(value)
        f.create_group("env")
        f.create_group("facts")
        f.create_group("dumps")
        f.create_dataset(
            "strings", shape=(0,), maxshape=(None,), dtype=h5py.string_dtype(), chunks=(1024,)
        )
        for name, dtype, chunk in (
            ("steps", STEP_DTYPE, 256),
            ("tensors", TENSOR_DTYPE, 1024),
            ("ops", OP_DTYPE, 8192),
            ("op_index", INDEX_DTYPE, 256),
        ):
            f.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(chunk,),
                compression="gzip", compression_opts=1, shuffle=True,
            )
        f.flush()
        self.n_steps = 0

    def set_attrs(self, attrs: dict[str, Any]) -> None:
        with _H5_LOCK:
            for key, value in attrs.items():
                self._file.attrs[key] = _attr(value)

    def add_env(self, env: dict[str, Any]) -> None:
        with _H5_LOCK:
            group = self._file["env"]
            for key, value in env.items():
                group.attrs[key] = _attr(value)

    def add_facts(self, facts: dict[str, Any]) -> None:
        with _H5_LOCK:
            group = self._file["facts"]
            for key, value in facts.items():
                group.attrs[key] = json.dumps(value)

    def add_strings(self, strings: list[str]) -> None:
        with _H5_LOCK:
            _append(self._file["strings"], np.array(strings, dtype=object))

    def add_step(self, row: np.ndarray) -> None:
        with _H5_LOCK:
            _append(self._file["steps"], row)
            self.n_steps += int((row["step"] >= 0).sum())
            self._file.attrs["steps"] = self.n_steps
            self._file.flush()

    def add_tensors(self, rows: np.ndarray) -> None:
        with _H5_LOCK:
            _append(self._file["tensors"], rows)

    def add_ops(self, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        with _H5_LOCK:
            ops = self._file["ops"]
            start = ops.shape[0]
            _append(ops, rows)
            index = np.zeros(1, dtype=INDEX_DTYPE)
            index["step"], index["start"], index["count"] = rows["step"][0], start, len(rows)
            _append(self._file["op_index"], index)

    def add_dump(self, name: str, array: np.ndarray, attrs: dict[str, Any]) -> None:
        with _H5_LOCK:
            ds = self._file["dumps"].create_dataset(name, data=array)
            for key, value in attrs.items():
                ds.attrs[key] = _attr(value)

    def close(self, status: str, exit_code: int | None) -> None:
        with _H5_LOCK:
            if not self._file.id.valid:
                return
            self._file.attrs["status"] = status
            self._file.attrs["exit_code"] = -1 if exit_code is None else exit_code
            self._file.close()


def _append(ds: Any, rows: np.ndarray) -> None:
    n = ds.shape[0]
    ds.resize((n + len(rows),))
    ds[n:] = rows


def _attr(value: Any) -> Any:
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    if value is None:
        return ""
    return value


@dataclass
class Capture:
    """Reader: a whole capture file loaded into memory (ops on demand, per step)."""

    path: Path
    attrs: dict[str, Any]
    env: dict[str, str]
    facts: dict[str, Any]
    strings: list[str]
    steps: np.ndarray
    _ops: np.ndarray = field(repr=False)
    _op_index: np.ndarray = field(repr=False)
    tensors: np.ndarray = field(repr=False)
    dumps: dict[str, tuple[np.ndarray, dict[str, Any]]] = field(repr=False)

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

    def step_row(self, step: int) -> np.ndarray | None:
        hit = np.nonzero(self.steps["step"] == step)[0]
        return self.steps[hit[0]] if len(hit) else None

    def op_steps(self) -> list[int]:
        return sorted({int(s) for s in self._op_index["step"]})

    def ops(self, step: int) -> np.ndarray:
        parts = [
            self._ops[int(r["start"]) : int(r["start"]) + int(r["count"])]
            for r in self._op_index
            if int(r["step"]) == step
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=OP_DTYPE)

    def tensor_rows(self, step: int) -> np.ndarray:
        return self.tensors[self.tensors["step"] == step]


def open_capture(path: str | Path) -> Capture:
    """Load a capture, or raise NondetError with a one-line reason and what to do."""
    path = Path(path)
    if not path.exists():
        raise NondetError(f"capture not found: {path}")
    h5py = _h5py()
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise NondetError(
            f"cannot read {path}: not an HDF5 file or truncated ({_first_line(exc)}); "
            "re-capture it with `nondet run`"
        )
    try:
        with f:
            version = str(f.attrs.get("nondet_format_version", ""))
            if not version:
                raise NondetError(f"{path} is an HDF5 file but not a nondet capture")
            try:
                major = int(version.split(".")[0])
            except ValueError:
                raise NondetError(f"{path}: unreadable format version {version!r}")
            if major > FORMAT_MAJOR:
                raise NondetError(
                    f"{path} was written in capture format {version}, newer than this "
                    f"nondet ({__version__}) reads; upgrade nondet"
                )
            dumps = {
                name: (np.asarray(ds[()]), {k: _decode(v) for k, v in ds.attrs.items()})
                for name, ds in f["dumps"].items()
            }
            return Capture(
                path=path,
                attrs={k: _decode(v) for k, v in f.attrs.items()},
                env={k: str(_decode(v)) for k, v in f["env"].attrs.items()},
                facts={k: json.loads(_decode(v)) for k, v in f["facts"].attrs.items()},
                strings=[s.decode() if isinstance(s, bytes) else str(s) for s in f["strings"][()]],
                steps=np.asarray(f["steps"][()], dtype=STEP_DTYPE),
                _ops=np.asarray(f["ops"][()], dtype=OP_DTYPE),
                _op_index=np.asarray(f["op_index"][()], dtype=INDEX_DTYPE),
                tensors=np.asarray(f["tensors"][()], dtype=TENSOR_DTYPE),
                dumps=dumps,
            )
    except NondetError:
        raise
    except (KeyError, OSError, ValueError) as exc:
        raise NondetError(
            f"cannot read {path}: damaged or incomplete capture ({_first_line(exc)})"
        )


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
