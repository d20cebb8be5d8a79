"""What the torch backend records, checked on small scripts run as real captured runs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from nondet.launch import CapturedRun, Plan, Target
from nondet.records import Flag, Kind, Phase
from nondet.store import Capture, open_capture


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
