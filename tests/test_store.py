"""The HDF5 capture: round trip, plain-h5py readability, bad files get one clear error."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from nondet.errors import NondetError
from nondet.records import OP_DTYPE
from nondet.store import FORMAT_VERSION, open_capture
from tests.conftest import OpStream, step_rows, write_capture


def _sample(tmp_path: Path) -> Path:
    ops = (OpStream().add(-1, "aten.randn.default", 5).add(0, "aten.mm.default", 6, 5)
           .add(0, "aten.relu.default", 7, 6))
    steps = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "params_fp": 2},
                      {"step": 1, "loss": 0.25, "params_fp": 3})
    return write_capture(tmp_path / "run.h5", steps, ops, env={"cpu_model": "x"},
                         facts={"dataloader#0": {"loader.in_order": False}},
                         dumps={"out0": np.arange(6, dtype=np.float32).reshape(2, 3)})


def test_round_trip(tmp_path: Path) -> None:
    c = open_capture(_sample(tmp_path))
    assert c.status == "complete" and c.complete and c.n_steps == 2
    assert c.env["cpu_model"] == "x"
    assert c.facts["dataloader#0"] == {"loader.in_order": False}
    assert [int(s) for s in c.steps["step"]] == [-1, 0, 1]
    assert c.op_steps() == [-1, 0]
    assert [c.string(int(n)) for n in c.ops(0)["name"]] == ["aten.mm.default",
                                                            "aten.relu.default"]
    assert c.dumps["out0"][0].shape == (2, 3)


def test_readable_with_plain_h5py(tmp_path: Path) -> None:
    path = _sample(tmp_path)
    with h5py.File(path, "r") as f:
        assert f.attrs["nondet_format_version"] == FORMAT_VERSION
        assert f["ops"].dtype == OP_DTYPE and f["ops"].dtype.itemsize == 64
        names = [s.decode() for s in f["strings"][()]]
        assert names[int(f["ops"][1]["name"])] == "aten.mm.default"


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NondetError, match="capture not found"):
        open_capture(tmp_path / "nope.h5")


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    path = _sample(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(NondetError, match=r"truncated|damaged"):
        open_capture(path)


def test_not_hdf5_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.h5"
    path.write_text("hello")
    with pytest.raises(NondetError, match="not an HDF5 file"):
        open_capture(path)


def test_hdf5_that_is_not_a_capture(tmp_path: Path) -> None:
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(NondetError, match="not a nondet capture"):
        open_capture(path)


def test_newer_major_format_is_refused_with_advice(tmp_path: Path) -> None:
    path = _sample(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["nondet_format_version"] = "2.0"
    with pytest.raises(NondetError, match="upgrade nondet"):
        open_capture(path)


def test_newer_minor_format_is_read(tmp_path: Path) -> None:
    path = write_capture(tmp_path / "run.h5", step_rows({"step": -1}, {"step": 0}, {"step": 1}),
                         attrs={"nondet_format_version": "1.7"})
    assert open_capture(path).n_steps == 2
