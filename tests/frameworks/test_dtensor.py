"""Parameters that are DTensors (FSDP2 / tensor parallel) on a 1-rank CPU mesh with gloo:
fingerprinted by their local shard, and a script using them runs under nondet."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from nondet.launch import CapturedRun, Plan, Target  # noqa: E402
from nondet.records import Group  # noqa: E402
from nondet.store import open_capture  # noqa: E402
from tests.conftest import REPO, run_cli  # noqa: E402

SCRIPT = """
import os, sys, tempfile
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

fd, store = tempfile.mkstemp(prefix="nondet-dtensor-")
os.close(fd)
os.unlink(store)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
for name, p in list(model.named_parameters()):
    value = distribute_tensor(p.detach() * scale, mesh, [Replicate()])
    setattr(model, name, torch.nn.Parameter(value))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = distribute_tensor(torch.randn(16, 8), mesh, [Replicate()])
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
assert type(model.weight.data).__name__ == "DTensor"
dist.destroy_process_group()
if os.path.exists(store):
    os.unlink(store)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "dtensor_train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def test_dtensor_script_is_deterministic_through_the_cli(script: Path, tmp_path: Path) -> None:
    # Before: run a failed in nondet's kept outputs (".numpy() is not supported for tensor
    # subclasses"), reported as the script's failure (exit 2).
    report = tmp_path / "report.json"
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "--json", str(report),
                     str(script), cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(report.read_text())
    assert data["verdict"] == "deterministic" and data["first_divergence"] is None


def _params(script: Path, out: Path, scale: str) -> tuple[list[int], dict[str, int]]:
    """Step-level parameter fingerprints of each step, and the per-tensor parameter
    fingerprints of step 0 (which has op capture)."""
    run = CapturedRun(Target(str(script), None, (scale,)), Plan("t", [0]), 0, out)
    run.start()
    result = run.wait()
    assert result.status == "complete" and not result.hook_error, result.log_tail()
    c = open_capture(result.path)
    steps = [int(c.step_row(s)["params_fp"]) for s in range(c.n_steps)]  # type: ignore[index]
    per_tensor = {c.string(int(r["name"])): int(r["fp"]) for r in c.tensor_rows(0)
                  if int(r["group"]) == Group.PARAM}
    return steps, per_tensor


def test_dtensor_parameters_are_fingerprinted_by_value(script: Path, tmp_path: Path) -> None:
    # Before: DTensors hashed to 0, so parameters were compared by shape only.
    steps_a, tensors_a = _params(script, tmp_path / "a", "1.0")
    steps_b, tensors_b = _params(script, tmp_path / "b", "1.0")
    steps_c, tensors_c = _params(script, tmp_path / "c", "2.0")
    assert set(tensors_a) == {"weight", "bias"}
    assert all(tensors_a.values()) and all(steps_a)
    assert (steps_a, tensors_a) == (steps_b, tensors_b)  # same values, same fingerprints
    for name in tensors_a:
        assert tensors_a[name] != tensors_c[name]
    assert all(a != c for a, c in zip(steps_a, steps_c, strict=True))
