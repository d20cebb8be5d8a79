"""Item 9 of issue 11: training that runs in child processes the script starts itself
(Hogwild on shared memory). Their steps are not recorded; the tensors handed to each child
are fingerprinted when the parent joins it, so a race between the children is never called
"deterministic", and training seen only in children is never "deterministic — 0 steps"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e

HOGWILD = str((REPO / "fixtures" / "torch" / "hogwild.py").relative_to(REPO))


def test_two_racing_forked_workers_are_nondeterministic(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "--json", str(report_path),
                     HOGWILD, "--main-steps", "0", "--worker-steps", "300", cwd=REPO)
    assert result.returncode == 1, result.stdout + result.stderr
    found = json.loads(report_path.read_text())["first_divergence"]
    assert found["step_fields"] == ["child #0 params"], found
    assert "child process #0" in found["notes"][0]


def test_one_spawned_worker_is_joined_and_not_called_deterministic(tmp_path: Path) -> None:
    """Spawn pickles the Process object: nondet's bookkeeping must not ride on it. One
    worker repeats exactly, but its steps were not recorded: exit 2, saying so."""
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), HOGWILD, "--main-steps", "0",
                     "--workers", "1", "--worker-steps", "20", "--start-method", "spawn",
                     cwd=REPO)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "training ran in child processes" in result.stderr
    assert "script failed" not in result.stderr


SPAWN_API = """
import os
import torch
import torch.multiprocessing as mp


def work(rank, model):
    with torch.no_grad():  # a different value in every run, outside the main process
        model.weight.add_(float(int.from_bytes(os.urandom(4), "little")))


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model.share_memory()
    mp.spawn(work, args=(model,), nprocs=1, start_method="fork")
    print(model.weight.sum().item())  # reads what the child left: not this op's doing
"""


def test_a_child_started_by_mp_spawn_is_blamed_not_the_op_that_reads_its_result(
        tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SPAWN_API)
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "--json", str(report_path),
                     str(script), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    found = json.loads(report_path.read_text())["first_divergence"]
    assert found["step_fields"] == ["child #0 params"], found


GLOBAL_MODEL = """
import multiprocessing as mp
import os
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
model.share_memory()
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def work():  # reaches the model through a global, not its args: only the final state shows it
    with torch.no_grad():
        model.weight.add_(float(int.from_bytes(os.urandom(4), "little")))


child = mp.get_context("fork").Process(target=work)
child.start()
child.join()
"""


def test_final_parameters_changed_by_a_child_are_read_afresh(tmp_path: Path) -> None:
    """The parent's fingerprint cache still holds the values from before the child ran (no
    version counter moved in this process): the final digest must not come from it."""
    script = tmp_path / "train.py"
    script.write_text(GLOBAL_MODEL)
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "--json", str(report_path),
                     str(script), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    found = json.loads(report_path.read_text())["first_divergence"]
    assert found["step_fields"] == ["final params"], found
