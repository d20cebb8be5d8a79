"""Damaged and crafted captures through the real CLI: one clear line, never a crash.

Real captures made by the real writer are mutated deterministically (byte flips, truncations,
crafted datasets and attributes, special files) and each is run through ``nondet show`` and
``nondet diff`` in a subprocess with a timeout. Every outcome must be exit 0/1 (the file is
still valid) or 2 with one line; never 3, a signal, a traceback, unbounded memory, or
"deterministic" for a file whose data was damaged. ``NONDET_FUZZ_VARIANTS=2000`` runs more
variants than the normal suite's few dozen (``NONDET_FUZZ_SEED`` picks another sequence).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from nondet.records import Flag, Kind, Phase
from tests.conftest import REPO, OpStream, step_rows, write_capture

VARIANTS = int(os.environ.get("NONDET_FUZZ_VARIANTS", "18"))
SEED = int(os.environ.get("NONDET_FUZZ_SEED", "20261123"))
TIMEOUT = 60.0
MAX_RSS_KIB = 400 * 1024  # a show/diff of a small file stays far below this

# Reads every attribute and dataset with plain h5py and prints a digest of the content: the
# oracle for "was the data damaged" (run in its own process: libhdf5 may crash on it).
ORACLE = r"""
import hashlib, sys, h5py, numpy as np
h = hashlib.sha256()
def attrs(obj):
    for k in sorted(obj.attrs):
        h.update(repr((obj.name, k, np.asarray(obj.attrs[k]).tolist())).encode())
def visit(name, obj):
    attrs(obj)
    if isinstance(obj, h5py.Dataset):
        h.update(repr((name, obj.dtype.str, obj.shape, np.asarray(obj[()]).tolist())).encode())
with h5py.File(sys.argv[1], "r") as f:
    attrs(f)
    f.visititems(visit)
print(h.hexdigest())
"""


@dataclass
class Outcome:
    code: int  # negative: killed by that signal
    stdout: str
    stderr: str
    max_rss_kib: int


_MEASURE = (
    "import os, resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[2:])\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "if code < 0:\n"
    "    os.kill(os.getpid(), -code)  # die by the same signal, as the test expects\n"
    "sys.exit(code)\n"
)


def _run(args: list[str], cwd: Path) -> Outcome:
    """Run a command with a timeout, measuring its peak memory (``os.wait4``)."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100", "PYTHONPATH": str(REPO),
           "NONDET_PROBE_SECONDS": "5"}  # a file libhdf5 loops on: exit 2 after 5 s
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # Run through a small wrapper: Linux keeps a process's peak RSS across exec, so a
        # command forked straight from a big pytest process would report pytest's memory.
        rss_file = Path(tempfile.mkstemp()[1])
        wrapped = [sys.executable, "-c", _MEASURE, str(rss_file), *args]
        proc = subprocess.Popen(wrapped, cwd=cwd, env=env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                pytest.fail(f"hung for {TIMEOUT:.0f} s: {' '.join(args)}")
            time.sleep(0.01)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        measured = rss_file.read_text().strip()
        rss_file.unlink()
        return Outcome(proc.returncode, out.read().decode(errors="replace"),
                       err.read().decode(errors="replace"),
                       int(measured) if measured else usage.ru_maxrss)


def _nondet(*args: str, cwd: Path) -> Outcome:
    return _run([sys.executable, "-m", "nondet", *args], cwd)


def _content(path: Path, cwd: Path) -> str | None:
    """Digest of everything the file holds, or None if plain h5py cannot read all of it."""
    result = _run([sys.executable, "-c", ORACLE, str(path)], cwd)
    return result.stdout.strip() if result.code == 0 else None


def _pristine(folder: Path) -> Path:
    ops = OpStream()
    for step in (-1, 0, 1):
        ops.add(step, "aten.randn.default", 10 + step, phase=Phase.INIT if step < 0
                else Phase.FORWARD, source="train.py:2", flags=int(Flag.RNG))
        ops.add(step, "numpy:torch.from_numpy", 20 + step, kind=Kind.ENTRY, source="train.py:3")
        ops.add(step, "aten.mm.default", 30 + step, 10 + step, module="encoder.layer",
                source="train.py:4")
        ops.add(step, "aten.index_put.default", 40 + step, 30 + step, module="table",
                phase=Phase.BACKWARD, source="train.py:5")
    steps = step_rows(*({"step": s, "loss": 1.0 / (s + 2), "params_fp": 100 + s,
                         "grads_fp": 200 + s, "data_fp": 300 + s} for s in range(-1, 6)))
    return write_capture(folder / "pristine.h5", steps, ops,
                         env={"cpu_model": "x", "env.OMP_NUM_THREADS": "2"},
                         facts={"dataloader#0": {"loader.in_order": False},
                                "numpy.unseeded_generator": ["train.py:1"]},
                         dumps={"kept-0-3-out0": np.arange(64, dtype=np.float32).reshape(8, 8)})


def _as_format_1_0(pristine: Path) -> Path:
    """The same capture as the 1.0 writer laid it out: no checksums anywhere (its byte flips
    are what once crashed and hung libhdf5; they cannot all be detected, only survived)."""
    path = pristine.with_name("legacy.h5")
    with h5py.File(pristine, "r") as src, h5py.File(path, "w") as dst:
        for key, value in src.attrs.items():
            if key not in ("nondet_digest", "nondet_strings_crc"):
                dst.attrs[key] = value
        dst.attrs["nondet_format_version"] = "1.0"
        for group in ("env", "facts", "dumps"):
            dst.create_group(group).attrs.update(dict(src[group].attrs))
        for name, ds in src.items():
            if isinstance(ds, h5py.Dataset):
                gzip = {} if name == "strings" else {"compression": "gzip", "shuffle": True}
                dst.create_dataset(name, data=ds[()], dtype=ds.dtype, maxshape=(None,),
                                   chunks=ds.chunks, **gzip)
        for name, ds in src["dumps"].items():
            dst["dumps"].create_dataset(name, data=ds[()])
    return path


# -- mutations: each writes a variant and says whether it is a crafted (malformed) file -----------
def _flip(rng: random.Random, data: bytearray) -> bytearray:
    for _ in range(rng.choice((1, 1, 2, 4, 16))):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    return data


def _truncate(rng: random.Random, data: bytearray) -> bytearray:
    return data[: rng.randrange(len(data))]


def _legacy(f: h5py.File) -> None:
    """What a format 1.0 writer left (no checksum attributes): the validators must hold."""
    for key in ("nondet_digest", "nondet_strings_crc"):
        if key in f.attrs:
            del f.attrs[key]


CRAFTED: list[Callable[[h5py.File, random.Random], None]] = [
    lambda f, r: f["steps"].resize((12_000_000,)),
    lambda f, r: f["ops"].resize((50_000_000,)),
    lambda f, r: f["strings"].resize((40_000_000,)),
    lambda f, r: _replace(f, "steps", np.zeros((3, 3), dtype=np.float64)),
    lambda f, r: _replace(f, "ops", np.zeros(4, dtype=np.int32)),
    lambda f, r: _replace(f, "strings", np.arange(5)),
    lambda f, r: _replace(f, "op_index", np.zeros((2, 2), dtype=np.int64)),
    lambda f, r: f.__delitem__(r.choice(["steps", "ops", "strings", "op_index", "tensors", "env",
                                         "facts", "dumps"])),
    lambda f, r: _set_field(f, "op_index", "start", r.choice([-5, 10**12, 2**62])),
    lambda f, r: _set_field(f, "op_index", "count", r.choice([-1, 10**9, 2**62])),
    lambda f, r: _set_field(f, "ops", "kind", 250),
    lambda f, r: _set_field(f, "ops", "phase", 99),
    lambda f, r: _set_field(f, "ops", "step", 7),
    lambda f, r: _set_field(f, "ops", r.choice(["name", "module", "source"]), -(2**31)),
    lambda f, r: _set_field(f, "steps", "step", -(2**31)),
    lambda f, r: f.attrs.__setitem__(r.choice(["exit_code", "steps", "seed", "rank"]),
                                     r.choice(["abc", np.arange(3), 1.5, "[/]"])),
    lambda f, r: f.attrs.__setitem__(r.choice(["status", "label", "script", "command"]),
                                     r.choice([np.arange(10**5), 123, b"\xff\xfe"])),
    lambda f, r: f.attrs.__setitem__("op_steps", r.choice(["[[", "{}", "[1.5]", "7"])),
    lambda f, r: f.attrs.__setitem__("nondet_format_version", r.choice(["x.y", "", "-", 7])),
    lambda f, r: f["facts"].attrs.__setitem__(r.choice(["dataloader#0",
                                                        "numpy.unseeded_generator"]),
                                              r.choice(["3", "{", '"x"', "[1, 2]", "null"])),
    lambda f, r: f["env"].attrs.__setitem__("cpu_model", np.arange(2_000_000)),
    lambda f, r: f["dumps"].create_dataset("kept-0-3-out1", data=np.array([b"x", b"y"])),
    lambda f, r: f["dumps"].create_dataset("kept-0-3-out2", shape=(10**6, 10**6), dtype="f8"),
    lambda f, r: f["dumps"]["kept-0-3-out0"].attrs.__setitem__("step", np.arange(10**6)),
]


def _replace(f: h5py.File, name: str, data: np.ndarray) -> None:
    del f[name]
    f[name] = data


def _set_field(f: h5py.File, name: str, field: str, value: int) -> None:
    rows = f[name][()]
    rows[field][len(rows) // 2] = value
    f[name][...] = rows


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _pristine(tmp_path_factory.mktemp("fuzz"))


def _variant(i: int, pristine: Path, folder: Path) -> tuple[Path, str]:
    rng = random.Random(SEED * 100_003 + i)
    path = folder / f"variant-{i}.h5"
    kind = rng.choice(("flip", "flip", "truncate", "crafted", "legacy-crafted",
                       "legacy-flip"))
    if kind in ("flip", "truncate", "legacy-flip"):
        base = _as_format_1_0(pristine) if kind == "legacy-flip" else pristine
        data = bytearray(base.read_bytes())
        path.write_bytes(_flip(rng, data) if kind == "flip" else _truncate(rng, data))
        return path, kind
    shutil.copyfile(pristine, path)
    which = rng.randrange(len(CRAFTED))
    with h5py.File(path, "r+") as f:
        if kind == "legacy-crafted":
            _legacy(f)
        CRAFTED[which](f, rng)
    return path, f"{kind}#{which}"


def _check(outcome: Outcome, what: str, one_line: bool = True) -> None:
    assert outcome.code >= 0, f"{what}: killed by signal {-outcome.code}"
    assert outcome.code in (0, 1, 2), f"{what}: exit {outcome.code}\n{outcome.stderr[-2000:]}"
    assert "Traceback" not in outcome.stderr, f"{what}: traceback\n{outcome.stderr[-2000:]}"
    assert outcome.max_rss_kib < MAX_RSS_KIB, f"{what}: {outcome.max_rss_kib} KiB of memory"
    if outcome.code == 2 and one_line:
        lines = outcome.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("nondet: error:"), \
            f"{what}: not one error line\n{outcome.stderr[-2000:]}"


@pytest.mark.parametrize("i", range(VARIANTS))
def test_damaged_or_crafted_capture(i: int, pristine: Path, tmp_path: Path) -> None:
    path, kind = _variant(i, pristine, tmp_path)
    what = f"variant {i} ({kind}, seed {SEED})"
    show = _nondet("show", "--ops", "0", str(path), cwd=tmp_path)
    diff = _nondet("diff", str(pristine), str(path), cwd=tmp_path)
    _check(show, f"{what}: show")
    _check(diff, f"{what}: diff")
    if kind == "legacy-flip":
        return  # no checksums in format 1.0: surviving it (above) is all that can be asked
    if kind.startswith(("crafted", "legacy-crafted")):
        # Every crafted edit makes a malformed capture: refused, not believed.
        assert show.code == 2 and diff.code == 2, f"{what}: accepted\n{show.stdout[-1500:]}"
        return
    damaged = _content(path, tmp_path) != _content(pristine, tmp_path)
    if damaged:
        assert diff.code != 0, f"{what}: damaged data called deterministic\n{diff.stdout}"
        assert show.code == 2, f"{what}: damaged data shown as valid\n{show.stdout[-1500:]}"


def test_pristine_pair_is_deterministic(pristine: Path, tmp_path: Path) -> None:
    """The control: the fuzzer's base capture is valid, and a byte-for-byte copy of it is
    the same run (``nondet diff`` refuses one file given twice: a copy, as every variant)."""
    twin = tmp_path / "twin.h5"
    shutil.copyfile(pristine, twin)
    outcome = _nondet("diff", str(pristine), str(twin), cwd=tmp_path)
    assert outcome.code == 0, outcome.stderr
    assert _nondet("show", "--ops", "0", str(pristine), cwd=tmp_path).code == 0


@pytest.mark.parametrize("numbers", [[-1, 0, 0, 0], [2, 1, 0, -1]], ids=["twice", "reversed"])
def test_steps_numbered_twice_or_out_of_order_are_refused(
        numbers: list[int], pristine: Path, tmp_path: Path) -> None:
    """Faults round 13: every /steps row numbered 0, or the rows reversed, got a verdict
    ("step 0, forward: runs diverge"); a run sends each step once, in order."""
    ops = OpStream()
    ops.add(0, "aten.mm.default", 30, 10, source="train.py:4")
    steps = step_rows(*({"step": s, "loss": 1.0, "params_fp": 100} for s in numbers))
    path = write_capture(tmp_path / "crafted.h5", steps, ops)
    outcome = _nondet("diff", str(pristine), str(path), cwd=tmp_path)
    _check(outcome, "crafted steps")
    assert outcome.code == 2 and "step numbers are not increasing" in outcome.stderr, outcome


def test_a_huge_environment_value_is_shown_cut(pristine: Path, tmp_path: Path) -> None:
    """Faults round 13: a capture's 5 MB /env value was printed whole (one `env diff` row;
    ``check``'s drift error was a 5 MB line)."""
    ops = OpStream()
    ops.add(0, "aten.mm.default", 30, 10, source="train.py:4")
    steps = step_rows(*({"step": s, "loss": 1.0, "params_fp": 100} for s in (-1, 0)))
    path = write_capture(tmp_path / "crafted.h5", steps, ops,
                         env={"cpu_model": "9" * 5_000_000, "env.OMP_NUM_THREADS": "2"})
    outcome = _nondet("diff", str(pristine), str(path), cwd=tmp_path)
    _check(outcome, "huge env value")
    row = next(line for line in outcome.stdout.splitlines() if "cpu_model" in line)
    assert "999" in row and len(row) < 1000 and len(outcome.stdout) < 20_000, len(row)


@pytest.mark.parametrize("special", ["fifo", "directory", "dev_zero", "socket", "symlink_fifo"])
def test_special_files_are_refused_at_once(special: str, pristine: Path, tmp_path: Path) -> None:
    path = tmp_path / "capture.h5"
    sock = None
    if special in ("fifo", "symlink_fifo"):
        os.mkfifo(tmp_path / "fifo")  # opening it for reading would block forever
        if special == "fifo":
            path = tmp_path / "fifo"
        else:
            path.symlink_to(tmp_path / "fifo")
    elif special == "directory":
        path.mkdir()
    elif special == "dev_zero":
        path = Path("/dev/zero")
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    try:
        for args in (("show", str(path)), ("diff", str(pristine), str(path))):
            started = time.monotonic()
            outcome = _nondet(*args, cwd=tmp_path)
            # click's own usage error (several lines) refuses a directory argument
            _check(outcome, f"{special}: {args[0]}", one_line=special != "directory")
            assert outcome.code == 2, outcome.stdout
            assert time.monotonic() - started < 20
    finally:
        if sock is not None:
            sock.close()
