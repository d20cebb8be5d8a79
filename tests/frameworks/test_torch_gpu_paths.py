"""The GPU paths of torch capture, run on this CPU machine: autograd worker threads
simulated with two threads, CUDA calls faked (streams, graphs, synchronize), auxiliary
kernel outputs with a CPU op, host read-backs counted in a real captured run.
The same paths on a real GPU: tests/gpu/test_cuda_paths.py (``make gpu-check``)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import torch

from nondet.frameworks.torch import cuda, optable, readback
from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.ops import CaptureMode, OpRecorder
from nondet.frameworks.torch.testing import FakeHost
from nondet.records import Kind
from tests.frameworks.test_torch_capture import capture, names


def _recorder() -> OpRecorder:
    recorder = OpRecorder(FakeHost(keep=True))  # type: ignore[arg-type]
    recorder.open_window()
    return recorder


def _rows(recorder: OpRecorder) -> list[tuple[str, int]]:
    recorder.resolve()
    rows = recorder.take_rows(0)
    return list(zip(names(recorder, rows), (int(r["out_fp"]) for r in rows), strict=True))


# -- item 4: autograd worker threads ---------------------------------------------------------
def _interleaved(order: list[str]) -> list[tuple[str, int]]:
    """Two threads (as the autograd engine's per-device workers: each with the caller's
    modes, one on CPU tensors, one on meta tensors) each run two ops; ``order`` says which
    thread runs its next op when."""
    recorder = _recorder()
    work: dict[str, list[Callable[[], object]]] = {
        "cpu": [lambda: torch.arange(6.0).reshape(2, 3).sum(0),
                lambda: torch.ones(3).cumsum(0)],
        "meta": [lambda: torch.ones(4, device="meta").sum(),
                 lambda: torch.ones(2, 2, device="meta").mm(torch.ones(2, 2, device="meta"))],
    }
    go = {name: threading.Semaphore(0) for name in work}
    done = threading.Semaphore(0)
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            with CaptureMode(recorder):
                for op in work[name]:
                    assert go[name].acquire(timeout=30)
                    op()
                    done.release()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            done.release()

    threads = [threading.Thread(target=worker, args=(name,)) for name in work]
    for t in threads:
        t.start()
    with CaptureMode(recorder):
        torch.ones(2).cumprod(0)  # the owner thread's own op (the CPU part of backward)
    for name in order:
        go[name].release()
        assert done.acquire(timeout=30)
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return _rows(recorder)


def test_records_of_two_worker_threads_do_not_depend_on_their_timing() -> None:
    one = _interleaved(["cpu", "meta", "cpu", "meta"])
    other = _interleaved(["meta", "meta", "cpu", "cpu"])
    assert len(one) == 11  # factories included
    assert one[1][0] == "aten.cumprod.default"  # the owner's records stay in place
    assert one == other


# -- item 5: auxiliary outputs ---------------------------------------------------------------
_LIB = torch.library.Library("nondet_aux_test", "DEF")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "attention(Tensor q) -> (Tensor out, Tensor rng_state, Tensor reserve)")


def _attention(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Like flash attention with dropout_p == 0: bookkeeping outputs nobody initialized.
    garbage = torch.from_numpy(np.frombuffer(os.urandom(16), dtype=np.int64).copy())
    return q.softmax(-1), garbage, garbage[:1].clone()


_LIB.impl("attention", _attention, "CPU")  # type: ignore[no-untyped-call]


def _attention_rows() -> list[tuple[str, int]]:
    recorder = _recorder()
    with CaptureMode(recorder):
        q = torch.linspace(0, 1, 8).reshape(2, 4)
        out, rng_state, reserve = torch.ops.nondet_aux_test.attention(q)
        # A consumer that does not depend on their values (a backward kernel without dropout)
        (rng_state * 0).sum()
        reserve.detach()
        out.sum()
    return _rows(recorder)


def test_auxiliary_outputs_are_never_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(optable.AUX_OUTPUTS, "attention", (1, 2))
    one, other = _attention_rows(), _attention_rows()
    assert [n for n, _ in one].count("aten.sum.default") == 2
    assert one == other  # without the table entry the attention and cat records differ


def test_the_table_names_real_bookkeeping_outputs() -> None:
    """Every entry points at Tensor returns of a real aten op that are RNG state, debug
    masks or reserve buffers, never at the attention output or its logsumexp."""
    for name, positions in optable.AUX_OUTPUTS.items():
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            returns = getattr(packet, overload)._schema.returns
            for i in positions:
                assert str(returns[i].type) == "Tensor", (name, i)
                label = returns[i].name or ("reserve" if "rnn" in name and i == 3 else "")
                assert any(k in label for k in ("rng", "philox", "unused", "debug", "reserve")
                           ), (name, i, label)
    # The CPU flash kernel has none: its two outputs are real (output, logsumexp).
    q = torch.randn(1, 2, 4, 8)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)
    assert len(out) == 2 and "_scaled_dot_product_flash_attention_for_cpu" not in (
        optable.AUX_OUTPUTS)


# -- item 9: cross-device copies ---------------------------------------------------------------
def test_cross_device_copies_are_hashed_not_derived() -> None:
    recorder = _recorder()
    hashed: list[torch.Tensor] = []
    original = recorder.fingerprint

    def spy(t: torch.Tensor, fp: Any = None) -> Any:
        hashed.append(t)
        return original(t, fp)

    recorder.fingerprint = spy  # type: ignore[method-assign]
    with CaptureMode(recorder):
        x = torch.arange(4.0) * 3  # hashed once
        same = x.to(torch.float64)  # a pointwise move on one device: derived
        moved = x.to("meta")  # across devices: hashed
        target = torch.empty(4, device="meta")
        target.copy_(x)  # across devices, in place: hashed
    assert any(t is moved for t in hashed) and any(t is target for t in hashed)
    assert not any(t is same for t in hashed)
    assert cuda.crosses_devices((x,), [moved]) and not cuda.crosses_devices((x,), [same])


# -- items 2 and 3: CUDA faked -------------------------------------------------------------------
class FakeGraph:
    replays = 0

    def replay(self) -> None:
        FakeGraph.replays += 1


def _fake_cuda(capturing: list[bool], stream: list[int], synced: list[Any]) -> Any:
    return SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        is_current_stream_capturing=lambda: capturing[0],
        current_stream=lambda device=None: SimpleNamespace(stream_id=stream[0]),
        synchronize=synced.append,
        CUDAGraph=type("CUDAGraph", (FakeGraph,), {}),
    )


@pytest.fixture()
def fake() -> Iterator[SimpleNamespace]:
    state = SimpleNamespace(capturing=[False], stream=[0], synced=[])
    original = cuda.api
    cuda.api = _fake_cuda(state.capturing, state.stream, state.synced)
    try:
        yield state
    finally:
        cuda.api = original


def test_ops_under_graph_capture_pass_through_and_are_hashed_after_replay(
        fake: SimpleNamespace) -> None:
    recorder = _recorder()
    hashed: list[torch.Tensor] = []
    original = recorder.hasher.content

    def spy(t: torch.Tensor, **kw: Any) -> Any:
        hashed.append(t)
        return original(t, **kw)

    recorder.hasher.content = spy  # type: ignore[method-assign,assignment]
    guards: list[int] = []

    class Guard:
        def __enter__(self) -> None:
            guards.append(1)

        def __exit__(self, *exc: object) -> None:
            return None

    cuda.install_replay_hook(recorder.graph_outputs, lambda: True, Guard)
    static_in = torch.ones(4)
    with CaptureMode(recorder):
        fake.capturing[0] = True
        static_out = (static_in * 2).exp()  # captured: recorded and hashed never
        static_in.add_(1)  # in place: written at replay, but not uninitialized memory
        fake.capturing[0] = False
        static_in.sum()  # before a replay: a value like any other, read and compared
    # static_in's entry and the sum's output: nothing of the captured ops
    assert len(hashed) == 2 and hashed[0] is static_in and len(recorder.records) == 2
    static_out.copy_(torch.full((4,), 7.0))  # what the replay's kernels write (no dispatch)
    graph = cuda.api.CUDAGraph()
    graph.replay()
    assert guards == [1] and FakeGraph.replays >= 1
    with CaptureMode(recorder):
        static_out.sum()  # first eager use: fingerprinted afresh, as an entry
    rows = _rows(recorder)[2:]
    assert rows[0][0].startswith("external:tensor")
    expected = _recorder()
    with CaptureMode(expected):
        torch.full((4,), 7.0).sum()
    # the replayed values: the same fingerprints as 7s made by a recorded op
    assert [fp for _, fp in rows] == [fp for _, fp in _rows(expected)]


def test_graph_outputs_read_before_a_replay_are_uninitialized(fake: SimpleNamespace) -> None:
    recorder = _recorder()
    with CaptureMode(recorder):
        fake.capturing[0] = True
        out = torch.ones(3) + torch.ones(3)
        fake.capturing[0] = False
        out.sum()  # garbage until replayed: never an entry point, never compared
    recorder.resolve()
    rows = recorder.take_rows(0)
    assert [int(r["kind"]) for r in rows] == [Kind.OP]
    assert len(recorder.graph_outputs) == 1


def test_hash_scratch_is_per_stream(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
                                    ) -> None:
    assert cuda.stream_key(torch.device("cuda", 0)) == (torch.device("cuda", 0), 0)
    fake.stream[0] = 3
    assert cuda.stream_key(torch.device("cuda", 0)) == (torch.device("cuda", 0), 3)
    assert cuda.stream_key(torch.device("cpu")) == torch.device("cpu")
    fake.stream[0] = 0
    # CPU devices stand for CUDA ones here: the key is what the fake current stream says.
    monkeypatch.setattr(cuda, "stream_key", lambda d: (d, fake.stream[0]))
    hasher = TorchHasher()
    cpu = torch.device("cpu")
    first = hasher.device._scratch_for(cpu, 10)
    fake.stream[0] = 7
    side = hasher.device._scratch_for(cpu, 10)
    fake.stream[0] = 0
    assert side is not first and hasher.device._scratch_for(cpu, 10) is first


def test_read_back_synchronizes_each_device_once(fake: SimpleNamespace) -> None:
    cuda.synchronize([torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cpu"),
                      torch.device("cuda", 1)])
    assert sorted(str(d) for d in fake.synced) == ["cuda:0", "cuda:1"]
    before = readback.READBACKS
    ints, floats = readback.read_back([torch.tensor(5), torch.tensor(-3)],
                                      [torch.tensor(0.25, dtype=torch.float64)])
    assert (ints, floats) == ([5, -3], [0.25])
    assert readback.READBACKS - before == 1


# -- item 8: host read-backs per step -----------------------------------------------------------
def test_host_read_backs_per_step_do_not_grow_with_the_model(tmp_path: Path) -> None:
    """Every step is captured op by op (per-tensor rows and statistics); nondet's own
    ``.item()``/``float()``/``.tolist()`` calls on tensors are counted by wrapping them."""
    out = tmp_path / "counts.json"
    c = capture(tmp_path, f"""
        import inspect, json, torch
        from nondet.frameworks.torch import readback
        calls = [0]
        def counting(name):
            original = getattr(torch.Tensor, name)
            def wrapper(self, *a, **k):
                caller = inspect.currentframe().f_back.f_globals.get("__name__", "")
                if caller.startswith("nondet."):
                    calls[0] += 1
                return original(self, *a, **k)
            setattr(torch.Tensor, name, wrapper)
        for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
            counting(name)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)])
        opt = torch.optim.Adam(model.parameters())
        per_step = []
        for _ in range(3):
            before, counted = calls[0], readback.READBACKS
            loss = model(torch.ones(4, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            per_step.append((calls[0] - before, readback.READBACKS - counted))
        json.dump(per_step, open({str(out)!r}, "w"))
        """)
    assert c.n_steps == 3
    per_step = json.loads(out.read_text())
    # 24 parameters, 24 gradients, 48 optimizer tensors: a read per tensor would be > 100.
    for calls, counted in per_step:  # each iteration includes its step's end
        assert calls <= 3 and counted <= 3, per_step


def test_compiled_regions_are_not_recorded_during_graph_capture(fake: SimpleNamespace) -> None:
    from nondet.frameworks.torch.compiled import Regions

    recorder = _recorder()
    backend = SimpleNamespace(recorder=recorder, paused=False, disabled=False)
    regions = Regions(backend)
    assert regions.recording()
    fake.capturing[0] = True  # reduce-overhead / torch.cuda.graph around a compiled call
    assert not regions.recording()
