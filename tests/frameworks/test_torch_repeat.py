"""nondet's own records repeat: a deterministic script gives the same op records every run.

A record written in one run and not in the other is a "structure" finding, so nothing that
decides whether a record is written may depend on addresses, ``id()`` reuse or GC timing
(Note [Storage identity] in frameworks/torch/tensors.py). Before that was so, the eval loop
below was reported nondeterministic in 6 of 8 invocations.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from nondet.launch import CapturedRun, Plan, Target
from nondet.store import Capture, open_capture

#: Fields of an op record that must repeat (everything but the string ids, which are
#: compared as the strings they stand for).
_FIELDS = ("kind", "phase", "flags", "out_fp", "in_fp", "taint_fp", "scalar_fp", "numel")
_STEP_FIELDS = ("params_fp", "buffers_fp", "grads_fp", "optim_fp", "data_fp", "loss_fp",
                "rng_fp", "n_records")

#: The pattern of many training scripts' eval loops, a deepcopy of the loss (metric states,
#: EMA copies), a scalar made from Python and a freed-and-remade tensor each step.
EVAL_LOOP = """
    import copy
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    history = []
    for step in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(copy.deepcopy(loss.detach()))
        losses = torch.zeros(3)
        with torch.no_grad():
            for k in range(3):
                losses[k] = model(x + k).pow(2).mean().item()
        history.append(losses.mean() + torch.tensor(float(step)))
    """


def record_stream(c: Capture) -> list[tuple[Any, ...]]:
    """Every op record and step row of a capture, with string ids resolved."""
    out: list[tuple[Any, ...]] = []
    for row in c.steps:
        out.append(("step", int(row["step"]), *(int(row[f]) for f in _STEP_FIELDS)))
    for step in sorted({int(s) for s in c.steps["step"]}):
        for r in c.ops(step):
            out.append((step, c.string(int(r["name"])), c.string(int(r["module"])),
                        c.string(int(r["source"])), *(int(r[f]) for f in _FIELDS)))
    return out


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"record {i}: {x} vs {y}"
    return f"lengths {len(a)} vs {len(b)}"


def capture_many(target: Target, out: Path, runs: int, parallel: int = 4,
                 stop_after: int | None = None) -> list[list[tuple[Any, ...]]]:
    """``runs`` captured runs of ``target`` with op capture at every step, a few at a time."""
    streams = []
    for start in range(0, runs, parallel):
        batch = [CapturedRun(target, Plan(f"r{i}", None, stop_after=stop_after), 0, out)
                 for i in range(start, min(runs, start + parallel))]
        for run in batch:
            run.start()
        for run in batch:
            result = run.wait()
            assert result.complete and not result.hook_error, result.log_tail()
            streams.append(record_stream(open_capture(result.path)))
    return streams


def test_a_deterministic_eval_loop_records_the_same_ops_every_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(EVAL_LOOP))
    streams = capture_many(Target(str(script), None, ()), tmp_path / "out", runs=20)
    assert len(streams[0]) > 100
    names = {r[1] for r in streams[0] if r[0] != "step"}
    assert "aten.copy_.default" in names and "external:tensor float32[]" in names
    differing = [f"run {i}: {first_difference(streams[0], s)}"
                 for i, s in enumerate(streams[1:], start=1) if s != streams[0]]
    assert not differing, "\n".join(differing)
