"""Memory shared with other processes (Hogwild): a sibling's write that lands while an op
of this process reads the shared weights is an entry of those weights, never "this op
created the difference" (Note [Writes during an op] in frameworks/torch/shared.py).

The sibling is made deterministic: a custom op whose implementation writes its shared
input through a NumPy view (unseen by the recorder, as another process's write is) before
it computes, so the op reads the written value although nondet hashed the old one as its
input."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest

pytest.importorskip("torch")

import torch

from nondet.compare import first_op_divergence
from nondet.frameworks.torch.testing import count_hashes, recording
from nondet.records import Kind

#: What the "sibling process" does while the op runs: set by each test, per run.
SIBLING: dict[str, Callable[[np.ndarray], None] | None] = {"write": None}


@torch.library.custom_op("nondet_tests::scale_by_shared", mutates_args=())
def scale_by_shared(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    write = SIBLING["write"]
    if write is not None:
        write(w.numpy())  # lands after nondet hashed w as this op's input
    return w * x


@torch.library.custom_op("nondet_tests::scale_shared_in_place", mutates_args=("w",))
def scale_shared_in_place(w: torch.Tensor, x: torch.Tensor) -> None:
    write = SIBLING["write"]
    if write is not None:
        write(w.numpy())
    w.mul_(x)  # the op writes w itself: its value afterwards is its output


def _shared_weight() -> torch.Tensor:
    w = torch.full((4,), 0.5)
    w.share_memory_()  # type: ignore[no-untyped-call]
    return w


def _bump(words: np.ndarray) -> None:
    words += 1.0


def _record(op: Callable[[torch.Tensor, torch.Tensor], object],
            write: Callable[[np.ndarray], None] | None, volatile: bool = True,
            on_device: bool = False) -> tuple[np.ndarray, list[str]]:
    """One "run": the shared weight read by ``op``, then used by the next op.
    ``on_device``: hashes take the device path (sums pending until the step's resolve)."""
    w = _shared_weight()
    x = torch.arange(4.0)
    SIBLING["write"] = write
    try:
        with recording() as recorder:
            recorder.shared_is_volatile = volatile
            if on_device:
                recorder.hasher.content = functools.partial(  # type: ignore[method-assign]
                    recorder.hasher.content, on_device=True)
            recorder.backend.tensor_name = (  # type: ignore[method-assign]
                lambda t: "parameter 0.weight" if t is w else None)
            y = op(w, x)
            (y if isinstance(y, torch.Tensor) else w).sum()
    finally:
        SIBLING["write"] = None
    strings: list[str] = recorder.session.strings  # type: ignore[attr-defined]  # FakeSession
    return recorder.take_rows(0), strings


@pytest.mark.parametrize("on_device", [False, True])
def test_a_write_landing_while_the_op_reads_shared_weights_is_their_entry(
        on_device: bool) -> None:
    a, strings_a = _record(scale_by_shared, _bump, on_device=on_device)
    b, strings_b = _record(scale_by_shared, None, on_device=on_device)
    found = first_op_divergence(a, b, strings_a, strings_b)
    assert found is not None and found.row_a is not None
    name = strings_a[int(found.row_a["name"])]
    assert (found.kind, name) == ("entry", "external:parameter 0.weight"), (found.kind, name)
    assert int(found.row_a["kind"]) == Kind.ENTRY
    # the very entry the op read (no record added: both runs keep the same records)
    assert len(a) == len(b)
    # the op that read it: its inputs differ, so it is not what created the difference
    op = next(i for i, r in enumerate(a)
              if strings_a[int(r["name"])] == "nondet_tests.scale_by_shared.default")
    assert op > found.position
    assert int(a[op]["in_fp"]) != int(b[op]["in_fp"])


def test_the_same_write_in_both_runs_is_no_difference() -> None:
    a, strings_a = _record(scale_by_shared, _bump)
    b, strings_b = _record(scale_by_shared, _bump)
    assert len(a) >= 3
    assert first_op_divergence(a, b, strings_a, strings_b) is None


def test_an_op_that_writes_the_shared_tensor_itself_is_not_re_read() -> None:
    """Its written value is its output, hashed as such: a difference there is the op's."""
    a, strings_a = _record(scale_shared_in_place, _bump)
    b, strings_b = _record(scale_shared_in_place, None)
    found = first_op_divergence(a, b, strings_a, strings_b)
    assert found is not None and found.row_a is not None
    assert found.kind == "op", found.kind
    assert strings_a[int(found.row_a["name"])] == "nondet_tests.scale_shared_in_place.default"


@pytest.mark.parametrize("volatile, hashes", [(False, 1), (True, 2)])
def test_shared_inputs_are_hashed_again_only_where_shared_memory_is_volatile(
        volatile: bool, hashes: int) -> None:
    """An ordinary process pays nothing: one hash of the shared tensor (its entry)."""
    w = _shared_weight()
    with recording() as recorder:
        recorder.shared_is_volatile = volatile
        hashed = count_hashes(recorder, w)
        scale_by_shared(w, torch.arange(4.0))
    assert len(hashed) == hashes


def test_trouble_re_reading_is_nondets_and_the_op_result_still_reaches_the_script() -> None:
    w = _shared_weight()
    failed: list[int] = []
    with recording() as recorder:
        recorder.shared_is_volatile = True
        recorder.backend.hook_failed = lambda: failed.append(1)  # type: ignore[method-assign]
        original = recorder.fingerprint

        def fingerprint_once(t: torch.Tensor, fp: object = None) -> object:
            recorder.fingerprint = broken  # type: ignore[method-assign,assignment]
            return original(t, fp)  # type: ignore[arg-type]

        def broken(t: torch.Tensor, fp: object = None) -> object:
            raise RuntimeError("a bug in nondet")

        recorder.fingerprint = fingerprint_once  # type: ignore[method-assign,assignment]
        y = torch.ops.aten.mul.Tensor(w, 3.0)  # hashed before (once), then again: raises
    assert torch.equal(y, torch.full((4,), 1.5))
    assert failed == [1]


# -- a sibling's write while an op writes the shared tensor itself (index_add_, a sparse add_)


def _index_add_run(write: Callable[[np.ndarray], None] | None, volatile: bool = True,
                   at_hash: int = 1) -> tuple[np.ndarray, list[str], torch.Tensor]:
    """One "run": ``table.index_add_`` on a shared table (Hogwild embedding updates); the
    "sibling" writes a row the op does not touch right after nondet hashed the table as the
    op's input (``at_hash=1``), so the write lands before the op has finished; or just
    before its output is hashed (``at_hash=2``): after the op, before nondet read it."""
    table = torch.zeros(8, 3)
    table.share_memory_()  # type: ignore[no-untyped-call]
    idx, src = torch.tensor([0, 1, 1, 2]), torch.ones(4, 3)
    pending = [write]
    hashes = [0]
    with recording() as recorder:
        recorder.shared_is_volatile = volatile
        recorder.backend.tensor_name = (  # type: ignore[method-assign]
            lambda t: "parameter 0.weight" if t is table else None)
        content = recorder.hasher.content

        def hash_then_sibling(t: torch.Tensor, on_device: bool = False) -> object:
            if t is table:
                hashes[0] += 1
            sibling = pending[0] if t is table and hashes[0] == at_hash else None
            if sibling is not None and at_hash == 2:  # lands just before the output hash
                pending[0] = None
                sibling(table.numpy())
            out = content(t, on_device=on_device)
            if sibling is not None and at_hash == 1:  # lands just after the input hash
                pending[0] = None
                sibling(table.numpy())
            return out

        recorder.hasher.content = hash_then_sibling  # type: ignore[method-assign,assignment]
        table.index_add_(0, idx, src)
        (table * 2).sum()
    strings: list[str] = recorder.session.strings  # type: ignore[attr-defined]  # FakeSession
    return recorder.take_rows(0), strings, table


def _bump_last_row(words: np.ndarray) -> None:
    words[7] += 1.0


@pytest.mark.parametrize("at_hash", [1, 2])
def test_a_sibling_write_during_an_in_place_op_is_the_entry_not_the_op(at_hash: int) -> None:
    """Landing after the input's hash, or after the op and before its output's hash:
    either way not the op's doing."""
    a, strings_a, table_a = _index_add_run(_bump_last_row, at_hash=at_hash)
    b, strings_b, table_b = _index_add_run(None)
    assert not torch.equal(table_a, table_b)  # the sibling's write did land in run a
    found = first_op_divergence(a, b, strings_a, strings_b)
    assert found is not None and found.row_a is not None
    name = strings_a[int(found.row_a["name"])]
    assert (found.kind, name) == ("entry", "external:parameter 0.weight"), (found.kind, name)
    assert len(a) == len(b)  # no record added


def test_an_in_place_op_alone_on_shared_memory_is_no_difference() -> None:
    """The control: re-running the op on a copy repeats its result, nothing is folded."""
    a, strings_a, table_a = _index_add_run(None)
    b, strings_b, _ = _index_add_run(None)
    assert first_op_divergence(a, b, strings_a, strings_b) is None
    _, _, table_p = _index_add_run(None, volatile=False)
    assert torch.equal(table_a, table_p)  # the script's own result is untouched


def test_an_in_place_random_op_on_shared_memory_is_never_run_again() -> None:
    """A re-run of ``bernoulli_`` would draw from the script's generator."""
    def draws(volatile: bool) -> torch.Tensor:
        w = _shared_weight()
        torch.manual_seed(5)
        with recording() as recorder:
            recorder.shared_is_volatile = volatile
            w.bernoulli_(0.5)
            return torch.rand(4)

    assert torch.equal(draws(True), draws(False))
