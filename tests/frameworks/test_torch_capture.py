"""What the torch backend records, checked on small scripts run as real captured runs."""

from __future__ import annotations

import copy
import io
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import torch
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import _disable_current_modes

from nondet.compare import first_op_divergence as localize
from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.ops import OpRecorder
from nondet.frameworks.torch.state import to_numpy as _to_numpy
from nondet.frameworks.torch.testing import count_hashes, recording
from nondet.launch import CapturedRun, Plan, Target
from nondet.records import Flag, Kind, Phase
from nondet.store import Capture, open_capture
from tests.conftest import run_cli


def capture(tmp_path: Path, body: str, op_steps: list[int] | None = None) -> Capture:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    run = CapturedRun(Target(str(script), None, ()), Plan("t", op_steps), 0, tmp_path / "out")
    run.start()
    result = run.wait()
    assert result.status == "complete", result.log_tail()
    return open_capture(result.path)


def records(c: Capture, step: int) -> list[tuple[str, str, str, str, int]]:
    """(name, phase, module, source line, flags) of a step's records."""
    return [(c.string(int(r["name"])), Phase(int(r["phase"])).label, c.string(int(r["module"])),
             c.string(int(r["source"])).rpartition(":")[2], int(r["flags"]))
            for r in c.ops(step)]


def test_optimizer_steps_phases_modules_and_backward_lines(tmp_path: Path) -> None:
    c = capture(tmp_path, """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.ones(2, 4)).sum()   # line 7
            opt.zero_grad()
            loss.backward()
            opt.step()                              # line 10
        """)
    assert c.n_steps == 3 and c.status == "complete"
    step0 = records(c, 0)
    forward = [r for r in step0 if r[1] == "forward" and r[0].startswith("aten.")]
    backward = [r for r in step0 if r[1] == "backward"]
    optimizer = [r for r in step0 if r[1] == "optimizer"]
    assert ("aten.addmm.default", "forward", "0", "7") in [r[:4] for r in forward]
    assert ("aten.tanh.default", "forward", "1", "7") in [r[:4] for r in forward]
    # Backward ops carry the module and line of the forward op that made their node.
    assert ("aten.tanh_backward.default", "backward", "1", "7") in [r[:4] for r in backward]
    assert any(r[0] == "aten.mm.default" and r[2] == "0" for r in backward)
    assert optimizer and all(r[3] == "10" for r in optimizer)
    # Per-tensor rows name parameters and gradients in steps with op capture.
    names = {c.string(int(r["name"])) for r in c.tensor_rows(0)}
    assert {"0.weight", "0.bias"} <= names


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpoints_recomputed_ops_and_their_backward_carry_module_and_line(
        tmp_path: Path, reentrant: bool) -> None:
    """A reentrant checkpoint recomputes its forward inside the backward and runs a backward
    of its own over it: those ops had no module and no line (a real race found in one was
    reported at no place of the script)."""
    c = capture(tmp_path, f"""
        import torch
        from torch.utils.checkpoint import checkpoint
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        head = torch.nn.Linear(4, 1)
        params = [*block.parameters(), *head.parameters()]
        opt = torch.optim.SGD(params, lr=0.1)
        for _ in range(2):
            x = torch.ones(3, 4, requires_grad=True)
            h = checkpoint(block, x, use_reentrant={reentrant})   # line 11
            loss = head(h).sum()
            opt.zero_grad()
            loss.backward()                               # line 14
            opt.step()
        """)
    backward = [r[:4] for r in records(c, 0) if r[1] == "backward"]
    assert ("aten.tanh_backward.default", "backward", "1", "11") in backward, backward
    assert ("aten.mm.default", "backward", "0", "11") in backward, backward
    unplaced = [r for r in backward if r[0].startswith("aten.") and r[3] in ("", "14")]
    # what remains without a place of its own: the engine's start (ones_like of the loss)
    # and the gradients' accumulation into the parameters' .grad
    assert all(r[0] in ("aten.ones_like.default", "aten.add.Tensor", "aten.detach.default",
                        "aten.clone.default") for r in unplaced), unplaced
    # the recomputed forward, recorded in the backward, is placed like the forward
    if reentrant:
        assert ("aten.tanh.default", "backward", "1", "11") in backward, backward


def test_hand_written_updates_make_one_step_per_backward(tmp_path: Path) -> None:
    c = capture(tmp_path, """
        import torch
        torch.manual_seed(0)
        w = torch.randn(5, requires_grad=True)
        lin = torch.nn.Linear(5, 1)
        for _ in range(4):
            loss = lin(w).sum()
            loss.backward()
            with torch.no_grad():
                for p in lin.parameters():
                    p -= 0.1 * p.grad
                lin.zero_grad()
        """)
    assert c.n_steps == 4
    assert any(r[1] == "optimizer" and r[0] == "aten.sub_.Tensor" for r in records(c, 0))


def test_explicit_steps_and_probes(tmp_path: Path) -> None:
    c = capture(tmp_path, """
        import torch, nondet
        x = torch.zeros(3)
        for i in range(5):
            x = x + i
            nondet.probe(x, "running")
            nondet.step()
        """)
    assert c.n_steps == 5
    assert "probe:running" in [r[0] for r in records(c, 0)]
    assert [int(r["step"]) for r in c.steps] == [0, 1, 2, 3, 4]
    assert all(int(r["probes_fp"]) != 0 for r in c.steps if int(r["step"]) >= 0)


def test_uninitialized_memory_is_marked_not_compared(tmp_path: Path) -> None:
    c = capture(tmp_path, """
        import torch
        buf = torch.empty(8)               # garbage
        buf.uniform_()                     # overwrites it
        junk = torch.empty(8) * 2          # reads garbage
        lin = torch.nn.Linear(2, 2)
        torch.optim.SGD(lin.parameters(), lr=0.1)
        """)
    init = records(c, -1)
    flags = {name: f for name, _, _, _, f in init}
    assert flags["aten.empty.memory_format"] & Flag.UNINIT_OUTPUT
    assert flags["aten.uniform_.default"] & Flag.OVERWRITES_UNINIT
    assert flags["aten.mul.Tensor"] & Flag.READS_UNINIT
    # Parameters wrap torch.empty memory: not entry points, and their init overwrites it.
    assert not any(name.startswith("external:") for name, *_ in init)


def test_data_from_outside_is_an_entry(tmp_path: Path) -> None:
    c = capture(tmp_path, """
        import numpy as np, torch
        lin = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        x = torch.from_numpy(np.ones((2, 3), dtype=np.float32))     # line 5
        y = torch.tensor([[1.0], [2.0]])                            # line 6
        loss = ((lin(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        """)
    entries = [(c.string(int(r["name"])), c.string(int(r["source"])).rpartition(":")[2])
               for r in c.ops(0) if int(r["kind"]) == Kind.ENTRY]
    assert ("numpy:torch.from_numpy", "5") in entries
    assert ("python_value:torch.tensor", "6") in entries
    data = [c.string(int(r["name"])) for r in c.tensor_rows(0) if int(r["group"]) == 4]
    assert any(d.startswith("numpy:torch.from_numpy @ ") for d in data)


def test_dataloader_batches_are_entries_with_loader_facts(tmp_path: Path) -> None:
    c = capture(tmp_path, """
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        data = TensorDataset(torch.arange(16.).view(8, 2))
        loader = DataLoader(data, batch_size=4)
        lin = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        for (x,) in loader:                                        # line 8
            lin(x).sum().backward()
            opt.step()
        """)
    assert c.n_steps == 2
    batch = [r for r in c.ops(0) if int(r["kind"]) == Kind.ENTRY
             and c.string(int(r["name"])).startswith("dataloader:")]
    assert batch and c.string(int(batch[0]["source"])).endswith(":8")
    assert c.facts["dataloader#0"]["loader.num_workers"] == 0
    assert c.facts["dataloader#0"]["loader.in_order"] is True


def test_steps_outside_the_op_window_have_no_op_records(tmp_path: Path) -> None:
    c = capture(tmp_path, """
        import torch
        lin = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        for _ in range(3):
            lin(torch.ones(1, 2)).sum().backward()
            opt.step()
        """, op_steps=[1])
    assert c.op_steps() == [1]
    assert [int(r["n_records"]) > 0 for r in c.steps] == [False, False, True, False]


# -- the recorder in this process: one tensor kind, dtype or pattern at a time ------------------
def names(recorder: OpRecorder, rows: np.ndarray, kind: Kind | None = None) -> list[str]:
    strings = recorder.session.strings
    return [strings[int(r["name"])] for r in rows if kind is None or int(r["kind"]) == kind]


def _nograd_view() -> torch.Tensor:
    w = torch.randn(4, 2, requires_grad=True)
    with torch.no_grad():
        v = w[0]
        v.fill_(0)
    return v


def _inference() -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones(3)


#: Tensors that user programs make and whose metadata torch refuses to give in some way.
ODD_TENSORS: dict[str, Callable[[], torch.Tensor]] = {
    "sparse_coo": lambda: torch.randn(3, 3).to_sparse(),
    "sparse_csr": lambda: torch.randn(3, 3).to_sparse_csr(),
    "nested": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
    "jagged": lambda: torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)],
                                                 layout=torch.jagged),
    "quantized": lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
    "meta": lambda: torch.empty(3, device="meta"),
    "inference": _inference,
    "nograd_view_modified": _nograd_view,
    "conj": lambda: torch.randn(3, dtype=torch.complex64).conj(),
    "mkldnn": lambda: torch.randn(3).to_mkldnn(),
    "expanded": lambda: torch.randn(1).expand(5),
    "two_tensor": lambda: TwoTensor(torch.randn(3), torch.randn(3)),
}

#: What a script does with a tensor: each either works or raises torch's own error.
USES: dict[str, Callable[[torch.Tensor], Any]] = {
    "clone": lambda t: t.clone(),
    "add": lambda t: t + t,
    "sum": lambda t: t.sum(),
    "view": lambda t: t.view(-1),
    "slice": lambda t: t[1:],
    "inplace": lambda t: t.mul_(2),
    "detach": lambda t: t.detach(),
    "grad_of_copy": lambda t: t.detach().requires_grad_().mul(2).sum(),
    "transpose": lambda t: t.t() if t.dim() == 2 else t.unsqueeze(0).t(),
}


def _origin(e: BaseException) -> str:
    """The last frame that raised, as "module" (nondet's frames show up here)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__", "?") if tb is not None else "?"


def _outcome(make: Callable[[], torch.Tensor], use: Callable[[torch.Tensor], Any],
             recorded: bool) -> str:
    t = make()
    try:
        if recorded:
            with recording() as recorder:
                use(t)
                use(t)  # second use: the cached fingerprint and the stamp of the first
            recorder.take_rows(0)
        else:
            use(t)
            use(t)
    except Exception as e:  # torch's own refusals are part of the outcome
        raised_by = "nondet" if _origin(e).startswith("nondet.") else "torch"
        return f"{type(e).__name__} raised by {raised_by}"
    return "ok"


@pytest.mark.parametrize("kind", sorted(ODD_TENSORS))
def test_the_recorder_never_changes_what_an_op_on_any_tensor_does(kind: str) -> None:
    """Every use of an odd tensor works or fails exactly as without nondet: reading its
    metadata (grad_fn, _version, storage, strides, sizes) never raises into the script."""
    for use_name, use in USES.items():
        plain = _outcome(ODD_TENSORS[kind], use, recorded=False)
        under = _outcome(ODD_TENSORS[kind], use, recorded=True)
        assert under == plain, f"{kind}.{use_name}: {under!r} under nondet, {plain!r} without"


def _every_dtype() -> list[torch.dtype]:
    found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return sorted(found, key=str)


def _make(dtype: torch.dtype, values: list[float]) -> torch.Tensor | None:
    source = torch.tensor(values)
    if dtype.is_complex:
        return torch.complex(source, -source).to(dtype)
    if dtype in (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return torch.quantize_per_tensor(source, 0.5, 2, dtype)
    try:
        return source.to(dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    t = torch.empty(len(values), dtype=torch.uint8)  # bits and sub-byte types: raw bytes
    t.copy_(torch.tensor([int(v) % 8 for v in values], dtype=torch.uint8))
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def test_every_dtype_fingerprints_and_has_statistics() -> None:
    made = 0
    for dtype in _every_dtype():
        t = _make(dtype, [0.0, 1.0, 2.0, 3.0])
        u = _make(dtype, [3.0, 2.0, 1.0, 0.0])
        if t is None or u is None:
            continue
        made += 1
        with recording() as recorder:
            t.detach()  # works for every dtype; t and u enter as entry points
            u.detach()
        rows = recorder.take_rows(0)
        fps = [int(r["out_fp"]) for r in rows if int(r["kind"]) == Kind.ENTRY]
        assert len(fps) == 2 and 0 not in fps and fps[0] != fps[1], dtype
        stats = TorchHasher.stats(t)  # fp8 has no max kernel: must not raise
        if t.is_floating_point() and dtype != torch.float4_e2m1fn_x2:
            assert stats is not None and float(stats[0]) != 0.0, dtype
    assert made >= 40  # float8 variants, complex32, quantized, bits, uint16/32/64 ...


def test_inference_tensors_are_hashed_once_per_write() -> None:
    with recording() as recorder, torch.inference_mode():
        x = torch.arange(1000.0)
        hashed = count_hashes(recorder, x)
        for _ in range(3):
            (x * 2).sum()  # old code: x fingerprinted again at every use
        before = recorder.known(x)
        x.add_(1)  # a recorded write: the next use must see the new value
        after = recorder.known(x)
    assert len(hashed) == 0
    assert before is not None and after is not None and before is not after


def recycled_addresses() -> tuple[int, int, int]:
    """(collisions, rounds, entries) of the loop below, in the calling process."""
    collisions = rounds = 0
    with recording() as recorder:
        # until the allocator has reused an address a few times (how often it does depends
        # on what else the process holds: up to 400 rounds)
        while collisions < 3 and rounds < 400:
            rounds += 1
            known = torch.ones(3) * 2  # produced by a recorded op
            address = known.untyped_storage()._cdata
            del known
            with _disable_current_modes():
                fresh = torch.from_numpy(np.full(3, 5.0, dtype=np.float32))
            collisions += fresh.untyped_storage()._cdata == address
            fresh + 1
    rows = recorder.take_rows(0)
    return collisions, rounds, len(names(recorder, rows, Kind.ENTRY))


def test_a_recycled_storage_address_never_decides_what_is_recorded() -> None:
    """A tensor made outside the ops (the scalar of ``losses[k] = x.item()``) is an entry
    point even when its storage lands where a freed, known storage was. In a fresh process:
    whether the allocator reuses an address here depends on the process's heap (a pytest
    worker that had run other files saw no reuse in 400 rounds)."""
    import json
    import subprocess
    import sys

    code = ("import json; from tests.frameworks.test_torch_capture import recycled_addresses;"
            " print(json.dumps(recycled_addresses()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    collisions, rounds, entries = json.loads(done.stdout.splitlines()[-1])
    assert collisions, "the allocator never reused an address: nothing was tested"
    assert entries == rounds


def test_deepcopy_uninitialized_storage_is_never_an_entry(tmp_path: Path) -> None:
    """deepcopy wraps a fresh, uninitialized storage with set_ and copies into it: the
    garbage is never evidence. A storage filled from outside (torch.load) is an entry where
    it is first read, at the line that wrapped it."""
    c = capture(tmp_path, """
        import copy, io
        import torch
        buf = io.BytesIO()
        torch.save(torch.full((4,), 0.5), buf)
        lin = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        kept = []
        for step in range(3):
            if step == 1:
                buf.seek(0)
                loaded = torch.load(buf)                               # line 12
                lin.weight.data.copy_(loaded)
            loss = lin(torch.ones(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept.append(copy.deepcopy(loss.detach()))
            kept.append(copy.deepcopy(lin).weight.sum())
        """, op_steps=None)
    entries = [(c.string(int(r["name"])), c.string(int(r["source"])).rpartition(":")[2])
               for s in range(-1, c.n_steps) for r in c.ops(s) if int(r["kind"]) == Kind.ENTRY]
    from_storage = [e for e in entries if "from a storage" in e[0]]
    assert from_storage == [("external:tensor from a storage (aten.set_)", "12")], entries
    copied = [r for r in c.ops(1) if c.string(int(r["name"])).startswith("aten.set_")]
    assert copied and all(int(r["out_fp"]) == 0 for r in copied)


def test_library_code_that_modifies_no_grad_views_in_place_runs_under_capture() -> None:
    """Views made under no_grad and then modified in place raise when their grad_fn is
    read: nn.Embedding(padding_idx=...), nn.init.orthogonal_, Adam on a complex parameter."""
    with recording() as recorder:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, padding_idx=0)
        lin = torch.nn.Linear(4, 4)
        with torch.no_grad():
            torch.nn.init.orthogonal_(lin.weight)
        z = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
        opt = torch.optim.Adam([*emb.parameters(), *lin.parameters(), z], lr=0.1)
        for _ in range(2):
            loss = lin(emb(torch.tensor([[0, 1, 2]]))).pow(2).mean() + (z * z.conj()).real.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert len(recorder.take_rows(0)) > 50


#: Scripts that crashed in nondet's hooks (reported as the script's failure); all of them
#: are deterministic. (script body, extra nondet options)
LIBRARY_PATTERNS = {
    "embedding_padding_idx": ("""
        m = torch.nn.Sequential(torch.nn.Embedding(10, 4, padding_idx=0), torch.nn.Linear(4, 1))
        params = list(m.parameters())
        forward = lambda: m(torch.tensor([[0, 1, 2], [3, 4, 0]])).pow(2).mean()
        """, []),
    "adam_complex_parameter": ("""
        z = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
        params = [z]
        forward = lambda: (z * z.conj()).real.sum()
        """, ["--ops", "all"]),
    "float8_buffer": ("""
        m = torch.nn.Linear(4, 1)
        m.register_buffer("scale", torch.full((4,), 0.5).to(torch.float8_e4m3fn))
        params = list(m.parameters())
        forward = lambda: m(torch.ones(2, 4) * m.scale.float()).pow(2).mean()
        """, []),
    "orthogonal_init_under_no_grad": ("""
        m = torch.nn.Linear(4, 4)
        with torch.no_grad():
            torch.nn.init.orthogonal_(m.weight)
        params = list(m.parameters())
        forward = lambda: m(torch.ones(2, 4)).pow(2).mean()
        """, []),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(LIBRARY_PATTERNS))
def test_library_patterns_run_to_a_deterministic_verdict(name: str, tmp_path: Path) -> None:
    body, options = LIBRARY_PATTERNS[name]
    script = tmp_path / f"{name}.py"
    loop = """
        opt = torch.optim.Adam(params, lr=0.1)
        for _ in range(3):
            loss = forward()
            opt.zero_grad()
            loss.backward()
            opt.step()
        """
    script.write_text("import torch\ntorch.manual_seed(0)\n" + textwrap.dedent(body)
                      + textwrap.dedent(loop))
    result = run_cli("run", "-q", *options, "--out", str(tmp_path / "out"), str(script),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("nondet: deterministic"), result.stdout


def test_bytes_outside_every_tensor_are_never_evidence() -> None:
    """deepcopy copies a tensor's whole storage, including bytes no tensor covers (a scalar
    loss can own a 64-byte storage). Two "runs" whose storages differ only there must give
    records that the comparison finds identical."""
    streams = []
    for junk in (1.0, 2.0):
        storage = torch.full((16,), junk)
        storage[0] = 0.25  # the only value any tensor shows
        scalar = storage[0]  # made outside the recorder: its storage is unknown to it
        with recording() as recorder:
            copied = copy.deepcopy(scalar)
            (copied * 2).sum()
            fresh = torch.ones(()) * 3  # known storage, bytes beyond it from the allocator
            copy.deepcopy(fresh) + 1
        streams.append((recorder.take_rows(0), recorder.session.strings))
    (a, strings_a), (b, strings_b) = streams
    assert len(a) > 5
    assert localize(a, b, strings_a, strings_b) is None


@pytest.mark.parametrize("read_all", [False, True])
def test_a_view_of_the_written_part_of_uninitialized_memory_is_no_difference(
        read_all: bool) -> None:
    """``k = torch.empty(16, 4, 3)``, two of its three columns written, ``k[..., :2]``
    read (torchdiffeq's Runge-Kutta scratch, trial round 12): the view shows only written
    values, so the op reading it is the same in both runs. Its fingerprint was derived from
    the whole of ``k``, garbage column included: "reads uninitialized memory" in a
    deterministic script, and ahead of a real difference, which it hid. Reading all of
    ``k`` still is that finding."""
    streams = []
    for junk in (1.0, 2.0):
        x = torch.arange(64.0).reshape(16, 4)
        with recording() as recorder:
            k = torch.empty(16, 4, 3)
            with _disable_current_modes():
                k[..., 2] = junk  # the allocator's garbage: unseen, and another per run
            k[..., 0] = x
            k[..., 1] = x * 2
            read = k if read_all else k[..., :2]
            (read * 0.5).sum(-1)
        streams.append((recorder.take_rows(0), recorder.session.strings))
    (a, strings_a), (b, strings_b) = streams
    found = localize(a, b, strings_a, strings_b)
    if not read_all:
        assert found is None
        return
    assert found is not None and found.row_a is not None
    assert strings_a[int(found.row_a["name"])] == "aten.mul.Tensor"
    assert found.reads_uninitialized


def test_a_loaded_tensor_is_an_entry_even_when_copied_before_it_is_read() -> None:
    """torch.load wraps storages filled from the file; a deepcopy of a loaded tensor before
    anything reads it must still show the loaded values as an entry point."""
    buf = io.BytesIO()
    torch.save(torch.arange(4.0), buf)
    buf.seek(0)
    with recording() as recorder:
        loaded = torch.load(buf)
        copied = copy.deepcopy(loaded)
        copied.sum()
    rows = recorder.take_rows(0)
    entries = names(recorder, rows, Kind.ENTRY)
    assert entries == ["external:tensor from a storage (aten.set_)"]
    reads = [r for r in rows if names(recorder, [r])[0] == "aten.sum.default"]
    assert reads and not int(reads[0]["flags"]) & Flag.READS_UNINIT


def test_kept_copies_never_stop_a_tensor_from_being_resized() -> None:
    """Outputs kept for the parent (lockstep) are host copies: ``Tensor.numpy()`` on the
    script's own memory would mark its storage as not resizable for good."""
    for t in (torch.randn(5), torch.randn(4, 3).t(), torch.randn(3).to(torch.bfloat16)):
        kept = _to_numpy(t)
        assert kept.flags.c_contiguous and torch.equal(torch.from_numpy(kept), t.float())
        t.resize_(40)  # raised "Trying to resize storage that is not resizable"


def test_training_on_the_meta_device_is_recorded_without_values(tmp_path: Path) -> None:
    """Faults round 9: ``torch.set_default_device("meta")`` and a training loop (shapes
    only) ended in nondet's own error: the loss and parameter sum, meta tensors, were read
    back. They have no values: NaN, and the run is recorded."""
    c = capture(tmp_path, """
        import torch
        torch.manual_seed(0)
        torch.set_default_device("meta")
        m = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(8, 4)
        for step in range(3):
            opt.zero_grad(); loss = m(x).pow(2).mean(); loss.backward(); opt.step()
        """)
    assert c.n_steps == 3 and c.status == "complete"


def test_ops_called_with_accumulate_true_are_marked(tmp_path: Path) -> None:
    """Which put_/index_put_ fix applies depends on accumulate (PT-PUT, PT-PUT-CPU)."""
    c = capture(tmp_path, """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        index = torch.tensor([0, 1, 1])
        for _ in range(2):
            t = model(torch.ones(2, 4)).detach().reshape(-1)
            t.put_(index, torch.ones(3))                     # line 9
            t.put_(index, torch.ones(3), accumulate=True)    # line 10
            t.index_put_((index,), torch.ones(3), True)      # line 11
            loss = model(torch.ones(2, 4) * t.sum()).sum()
            opt.zero_grad(); loss.backward(); opt.step()
        """)
    marked = {(name, line): bool(flags & Flag.ACCUMULATES)
              for name, _, _, line, flags in records(c, 0) if line in ("9", "10", "11")}
    assert marked[("aten.put_.default", "9")] is False, marked
    assert marked[("aten.put_.default", "10")] is True, marked
    assert any(accumulated for (name, line), accumulated in marked.items()
               if line == "11" and "index_put" in name), marked
