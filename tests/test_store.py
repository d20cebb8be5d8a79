"""The HDF5 capture: round trip, plain-h5py readability, bad files get one clear error."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from nondet.errors import NondetError
from nondet.records import INDEX_DTYPE, OP_DTYPE, TENSOR_DTYPE
from nondet.store import FORMAT_VERSION, open_capture, probe
from tests.conftest import OpStream, run_cli, step_rows, write_capture


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


# -- damage is detected, crafted shapes are refused, format 1.0 still opens -----------------------
def _flip_in(path: Path, needle: bytes, offset: int = 0) -> Path:
    """A copy of ``path`` with one bit flipped in the first occurrence of ``needle``."""
    data = bytearray(path.read_bytes())
    at = data.index(needle) + offset
    data[at] ^= 0x01
    damaged = path.with_name("damaged.h5")
    damaged.write_bytes(bytes(data))
    return damaged


def _dump_offset(path: Path) -> int:
    with h5py.File(path, "r") as f:
        ds = f["dumps"]["out0"]
        return ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()


def test_every_table_and_dump_carries_a_checksum(tmp_path: Path) -> None:
    with h5py.File(_sample(tmp_path), "r") as f:
        for name in ("steps", "tensors", "ops", "op_index", "dumps/out0"):
            assert f[name].fletcher32, name
        assert f.libver[0] != "earliest"  # metadata (object headers) is checksummed too


@pytest.mark.parametrize("needle", [b"aten.relu.default", b"complete", b"cpu_model"])
def test_a_flipped_bit_in_strings_or_attributes_is_damage(tmp_path: Path,
                                                          needle: bytes) -> None:
    damaged = _flip_in(_sample(tmp_path), needle, offset=2)
    with pytest.raises(NondetError, match="damaged capture"):
        open_capture(damaged)


def test_a_flipped_bit_in_a_dump_is_found_before_a_verdict(tmp_path: Path) -> None:
    path = _sample(tmp_path)
    data = bytearray(path.read_bytes())
    data[_dump_offset(path) + 5] ^= 0x10
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes(bytes(data))
    result = run_cli("diff", str(path), str(damaged), cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert "damaged capture" in result.stderr and "checksum" in result.stderr


def test_declared_rows_beyond_the_stored_bytes_are_refused_before_reading(
        tmp_path: Path) -> None:
    path = _sample(tmp_path)
    with h5py.File(path, "r+") as f:
        f["steps"].resize((3_000_000,))  # declares 288 MB in a file of a few KiB
    with pytest.raises(NondetError, match="declares 3,000,000 rows"):
        open_capture(path)


def test_op_records_are_read_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = open_capture(_sample(tmp_path))
    reads: list[object] = []
    ds = c._file["ops"]
    monkeypatch.setattr(c, "_file", {"ops": _Spy(ds, reads)})
    assert len(c.ops(0)) == 2 and reads == [slice(1, 3)]


class _Spy:
    def __init__(self, ds: object, reads: list[object]) -> None:
        self.ds, self.reads = ds, reads

    def __getitem__(self, key: object) -> object:
        self.reads.append(key)
        return self.ds[key]  # type: ignore[index]


def test_format_1_0_without_checksums_still_opens(tmp_path: Path) -> None:
    """A capture as the 1.0 writer left it: default object format, gzip only, no digests."""
    path = tmp_path / "old.h5"
    steps = step_rows({"step": -1}, {"step": 0, "params_fp": 2})
    ops = np.zeros(1, dtype=OP_DTYPE)
    with h5py.File(path, "w") as f:
        f.attrs.update({"nondet_format_version": "1.0", "status": "complete", "exit_code": 0,
                        "steps": 1, "label": "old"})
        f.create_group("env").attrs["torch_version"] = "2.1.0"
        f.create_group("facts")
        f.create_group("dumps")
        f.create_dataset("strings", data=np.array(["aten.mm.default"], dtype=object),
                         dtype=h5py.string_dtype(), maxshape=(None,), chunks=(1024,))
        index = np.zeros(1, dtype=INDEX_DTYPE)
        index["count"] = 1
        for name, rows in (("steps", steps), ("tensors", np.zeros(0, dtype=TENSOR_DTYPE)),
                           ("ops", ops), ("op_index", index)):
            f.create_dataset(name, data=rows, maxshape=(None,), chunks=(256,),
                             compression="gzip")
    c = open_capture(path)
    c.verify()
    assert c.n_steps == 1 and c.env["torch_version"] == "2.1.0"
    assert c.string(int(c.ops(0)["name"][0])) == "aten.mm.default"


# -- libhdf5 itself can crash or loop on a damaged file: the first read is in a child ------------
def test_a_file_that_hangs_libhdf5_is_exit_2_after_the_deadline(tmp_path: Path) -> None:
    """A byte-flipped format 1.0 capture on which libhdf5 loops forever reading an attribute
    (found by the fuzzer): the old reader hung with it."""
    hangs = Path(__file__).parent / "data" / "legacy_flipped_hangs_libhdf5.h5"
    result = run_cli("show", str(hangs), cwd=tmp_path, env={"NONDET_PROBE_SECONDS": "2"},
                     timeout=60)
    assert result.returncode == 2, result.stderr
    assert "did not finish within" in result.stderr


def test_probe_turns_a_crash_or_a_hang_into_one_error(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _sample(tmp_path)
    # the forked probe, which runs the given read: as in nondet's own one-thread process
    # (pytest-timeout's timer thread would make it a fresh interpreter, which reads for real)
    monkeypatch.setattr(probe.threading, "active_count", lambda: 1)
    with pytest.raises(NondetError, match=r"crashed reading it: SIGSEGV"):
        probe.probe(path, lambda p: os.kill(os.getpid(), signal.SIGSEGV))
    monkeypatch.setattr(probe, "PROBE_SECONDS", 0.5)
    with pytest.raises(NondetError, match="did not finish"):
        probe.probe(path, lambda p: time.sleep(60))
    with pytest.raises(NondetError, match="one clear line"):
        probe.probe(path, lambda p: (_ for _ in ()).throw(NondetError("one clear line")))
    assert probe.probe(path, lambda p: None) is True


def test_only_files_this_process_did_not_write_are_probed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[Path] = []
    real = probe.probe
    monkeypatch.setattr(probe, "probe", lambda p, read: probed.append(p) or real(p, read))
    path = _sample(tmp_path)
    open_capture(path)
    assert probed == []  # written by this process, unchanged since
    with h5py.File(path, "r+") as f:
        f.attrs["label"] = "changed"
    with pytest.raises(NondetError, match="attribute checksum"):
        open_capture(path)
    assert probed == [path]


def test_with_other_threads_alive_the_probe_is_a_fresh_interpreter(tmp_path: Path) -> None:
    """Forking while another thread may hold h5py's lock could deadlock the child."""
    import threading

    path = _sample(tmp_path)
    damaged = _flip_in(path, b"aten.relu.default", offset=2)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert probe.probe(path, lambda p: os._exit(9)) is True  # not forked: read ignored
        with pytest.raises(NondetError, match="string table checksum"):
            probe.probe(damaged, lambda p: None)
    finally:
        stop.set()
        thread.join()


def test_no_single_read_exceeds_the_cap_whatever_the_compression(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deflate bomb stores a little and declares a lot; the cap bounds any one read."""
    from nondet.store import checks

    path = write_capture(tmp_path / "run.h5", step_rows(*({"step": s} for s in range(-1, 40))))
    monkeypatch.setattr(checks, "MAX_READ_BYTES", 2000)  # 41 step rows are 3,936 bytes
    with pytest.raises(NondetError, match="more than nondet reads at once"):
        open_capture(path)


def _with_comm(path: Path, rows: list[tuple[int, int, int, int, int, int, int]]) -> Path:
    from nondet.records import COMM_DTYPE
    from nondet.store import CaptureWriter

    writer = CaptureWriter(path, {"label": "a", "seed": 0})
    writer.add_strings(["c10d.allreduce_.default", "gloo"])
    writer.add_comm(np.array(rows, dtype=COMM_DTYPE))
    writer.add_step(step_rows({"step": 0}))
    writer.close("complete", 0)
    return path


def test_collective_rows_round_trip_and_a_bad_one_is_damage(tmp_path: Path) -> None:
    capture = open_capture(_with_comm(tmp_path / "a.h5", [(0, 3, 1, 2, 0, 580, 2)]))
    row = capture.comm_row(0, 3)
    assert row is not None and capture.string(int(row["backend"])) == "gloo"
    assert (int(row["group_size"]), int(row["bucket"]), int(row["nbytes"]),
            int(row["output"])) == (2, 0, 580, 2)
    assert capture.comm_row(0, 4) is None
    with pytest.raises(NondetError, match="/comm"):  # a backend id past the string table
        open_capture(_with_comm(tmp_path / "b.h5", [(0, 3, 9, 2, 0, 580, 2)]))


def test_a_file_without_the_comm_table_reads_as_no_collectives(tmp_path: Path) -> None:
    path = _with_comm(tmp_path / "a.h5", [(0, 3, 1, 2, 0, 580, 2)])
    with h5py.File(path, "a") as f:  # as written before the table existed
        del f["comm"]
    assert len(open_capture(path).comm) == 0


def test_a_probe_past_the_users_own_limit_names_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deadline the user set (tiny, say) is named with what to do; nondet's own default
    deadline passing still means a damaged capture ("within 0 s" of a damaged one, before)."""
    path = tmp_path / "run-a.h5"
    monkeypatch.setenv("NONDET_PROBE_SECONDS", "0.001")
    with pytest.raises(NondetError, match=r"within 0\.001 s, the limit NONDET_PROBE_SECONDS"):
        probe._judge(path, 0.001, None, "")
    monkeypatch.delenv("NONDET_PROBE_SECONDS")
    with pytest.raises(NondetError, match=r"damaged capture \(reading it did not finish"):
        probe._judge(path, 20.0, None, "")
