"""The CUDA paths of torch capture on a real GPU (docs/architecture.md, "GPU: written, not
yet run"). Skipped without CUDA; ``make gpu-check`` runs this file and the benchmark when a
device is present. The same logic with CUDA faked: tests/frameworks/test_torch_gpu_paths.py.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import torch.nn.functional as F

from nondet.frameworks.torch import cuda, optable, readback
from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.ops import CaptureMode, OpRecorder
from nondet.frameworks.torch.testing import FakeHost
from tests.frameworks.test_torch_capture import names


def _recorder() -> OpRecorder:
    recorder = OpRecorder(FakeHost(keep=True))  # type: ignore[arg-type]
    recorder.open_window()
    return recorder


def _rows(recorder: OpRecorder) -> list[tuple[str, int]]:
    recorder.resolve()
    rows = recorder.take_rows(0)
    return list(zip(names(recorder, rows), (int(r["out_fp"]) for r in rows), strict=True))


def test_hashes_on_two_streams_at_once_equal_the_host_hash() -> None:
    hasher = TorchHasher()
    data = [torch.randn(1 << 21, device="cuda") for _ in range(2)]
    expected = [hasher.content(t.cpu(), on_device=False) for t in data]
    streams = [torch.cuda.Stream() for _ in data]  # type: ignore[no-untyped-call]
    sums = []
    for t, s in zip(data, streams, strict=True):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            sums.append(hasher.content(t))
    # read_back synchronizes every stream first
    ints, _ = readback.read_back([s for s in sums if isinstance(s, torch.Tensor)])
    assert [v & (2**64 - 1) for v in ints] == [int(e) & (2**64 - 1) for e in expected]  # type: ignore[arg-type]
    keys = list(hasher.device._local.__dict__["s"])
    assert len({k for k in keys if isinstance(k, tuple)}) == 2  # one scratch per stream


def test_graph_capture_is_not_disturbed_and_replayed_outputs_are_hashed() -> None:
    recorder = _recorder()
    cuda.install_replay_hook(recorder.graph_outputs, lambda: True, _null)
    static_in = torch.ones(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with CaptureMode(recorder):
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            (static_in * 2).exp()  # warm-up, recorded normally
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static_out = (static_in * 2).exp()  # captured: must not raise, not recorded
        before = len(recorder.records)
        static_in.fill_(3.0)
        graph.replay()
        static_out.sum()
    rows = _rows(recorder)
    # The captured ops added nothing; the replayed output enters at its first eager use.
    assert [n.split(":")[0] for n, _ in rows[before:]] == [
        "aten.fill_.Scalar", "external", "aten.sum.default"]
    expected = TorchHasher().content((torch.full((1024,), 3.0) * 2).exp())
    recorder2 = _recorder()
    with CaptureMode(recorder2):
        ((torch.full((1024,), 3.0, device="cuda") * 2).exp()).sum()
    assert expected is not None and rows[-1][1] == _rows(recorder2)[-1][1]


def _null() -> _Null:
    return _Null()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("backend", ["flash", "efficient"])
def test_attention_bookkeeping_outputs_are_never_compared(backend: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = SDPBackend.FLASH_ATTENTION if backend == "flash" else (
        SDPBackend.EFFICIENT_ATTENTION)
    runs = []
    for _ in range(5):
        torch.cuda.empty_cache()
        recorder = _recorder()
        q = torch.linspace(0, 1, 2 * 4 * 128 * 64, device="cuda", dtype=torch.float16)
        q = q.reshape(2, 4, 128, 64).requires_grad_()
        with CaptureMode(recorder), sdpa_kernel(chosen):
            out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
            torch.autograd.backward(out.sum())
        runs.append(_rows(recorder))
    attention = [n for n, _ in runs[0] if "attention" in n and "backward" not in n]
    assert attention and attention[0].split(".")[1] in optable.AUX_OUTPUTS
    forward = [[fp for n, fp in rows if n in attention] for rows in runs]
    assert all(f == forward[0] for f in forward)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_backward_on_two_devices_records_in_a_fixed_order() -> None:
    orders = []
    for _ in range(5):
        recorder = _recorder()
        a = torch.randn(256, 256, device="cuda:0", requires_grad=True)
        b = torch.randn(256, 256, device="cuda:1", requires_grad=True)
        with CaptureMode(recorder):
            loss = (a @ a).sum().to("cuda:1") + (b @ b).sum()
            loss.backward()  # type: ignore[no-untyped-call]
        orders.append([n for n, _ in _rows(recorder)])
    assert all(o == orders[0] for o in orders)


def test_one_read_back_per_device_per_resolve() -> None:
    recorder = _recorder()
    with CaptureMode(recorder):
        x = torch.randn(4096, device="cuda")
        for _ in range(20):  # 40 hashed outputs
            x = torch.mm(x.reshape(64, 64), x.reshape(64, 64)).reshape(-1).tanh().cumsum(0)
    before = readback.READBACKS
    recorder.resolve()
    assert readback.READBACKS - before == 1


def test_a_non_blocking_copy_is_hashed_at_the_copy() -> None:
    recorder = _recorder()
    hashed: list[torch.Tensor] = []
    original = recorder.fingerprint

    def spy(t: torch.Tensor, fp: Any = None) -> Any:
        hashed.append(t)
        return original(t, fp)

    recorder.fingerprint = spy  # type: ignore[method-assign]
    with CaptureMode(recorder):
        host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
        device = host.to("cuda", non_blocking=True)
    assert any(t is device for t in hashed)
    rows = _rows(recorder)
    assert rows[-1][1] not in (0, 1)


def test_an_nccl_collectives_output_is_hashed_on_the_device_after_its_stream_work(
        tmp_path: Any) -> None:
    """The NCCL path of comm.py/comm_cuda.py: the record of an async all_reduce holds the
    hash of its result, queued after the work on the current stream (no host sync)."""
    import torch.distributed as dist

    from nondet.frameworks.fp import combined
    from nondet.frameworks.torch import comm
    from nondet.records import CommOutput

    if not dist.is_nccl_available():
        pytest.skip("torch built without NCCL")
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    recorder = _recorder()
    comm.install(recorder.collectives.waited)
    try:
        with CaptureMode(recorder):
            x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
            work = dist.all_reduce(x, async_op=True)
            work.wait()  # NCCL: the current stream waits; the host does not
        recorder.resolve()
        recorder.merge_threads()
        comm_rows = recorder.collectives.take_rows(0, recorder.records,
                                                   recorder.session.intern)
        rows = recorder.take_rows(0)
        at = names(recorder, rows).index("c10d.allreduce_.default")
        again = _recorder()
        fp = again.fingerprint(x)
        again.resolve()
        assert int(comm_rows[0]["output"]) == CommOutput.ON_DEVICE
        assert int(rows[at]["out_fp"]) == combined([fp]) != 0
    finally:
        comm.install(lambda work: None)
        dist.destroy_process_group()
