"""A generator made without a seed in the script's own code, read by DataLoader workers:
its recipe comes first, not per-worker seeding (DATA-PT-WORKERSEED), which cannot reach an
instance the dataset made itself. Found with a Dataset keeping ``random.Random()`` (a
T5 span-corruption collator, pytorch/examples style): the first fix shown did not work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nondet import recipe
from tests.conftest import run_cli

_BATCH = {"framework": "torch", "kind": "entry", "entry_kind": "dataloader",
          "phase": "data", "loader.num_workers": 2, "torch_version": "2.13.0"}


@pytest.mark.parametrize(("fact", "first"), [("python.unseeded_random", "PY-ENTROPY"),
                                             ("numpy.unseeded_generator", "PY-NP-GENERATOR")])
def test_an_unseeded_generator_read_by_workers_is_the_first_cause(fact: str,
                                                                   first: str) -> None:
    ranked = [s.recipe.id for s in recipe.suggest({**_BATCH, fact: True}, limit=5)]
    assert ranked[0] == first and "DATA-PT-WORKERSEED" in ranked, ranked


def test_without_an_unseeded_generator_workers_are_seeded() -> None:
    ranked = [s.recipe.id for s in recipe.suggest(_BATCH, limit=5)]
    assert ranked[0] == "DATA-PT-WORKERSEED", ranked


def test_the_fix_says_how_a_generator_object_is_seeded() -> None:
    fix = recipe.suggest({**_BATCH, "python.unseeded_random": True})[0].fix
    assert "random.Random(seed)" in fix


MADE_IN_WORKERS = """
import numpy as np, torch
from torch.utils.data import DataLoader, Dataset

class Noisy(Dataset):
    def __init__(self):
        self.x = torch.randn(128, 8)
    def __len__(self):
        return 128
    def __getitem__(self, i):
        rng = np.random.default_rng()  # made in the worker, per sample, never seeded
        return self.x[i] + torch.from_numpy(rng.normal(0, 0.1, 8).astype("float32"))

if __name__ == "__main__":
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for x in DataLoader(Noisy(), batch_size=32, num_workers=2):
        loss = net(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_generator_made_in_the_workers_is_named_at_its_line(tmp_path: Path) -> None:
    """Trial: ``np.random.default_rng()`` made in ``__getitem__`` (so in the DataLoader's
    forked workers, whose hooks cannot use the run's pipe) went unseen: the first fix was
    per-worker seeding, which cannot seed it."""
    script = tmp_path / "train.py"
    script.write_text(MADE_IN_WORKERS)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script),
                     cwd=tmp_path, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    first = report["suggestions"][0]
    assert first["id"] == "PY-NP-GENERATOR", [s["id"] for s in report["suggestions"]]
    assert "train.py:11" in result.stdout, result.stdout


GLOBAL_RESEEDED = """
import numpy as np, torch

torch.manual_seed(0)
np.random.seed(None)  # the legacy global generator from fresh entropy
net = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x = torch.ones(16, 8)
for _ in range(3):
    noisy = x + torch.from_numpy(np.random.normal(0, 0.1, (16, 8)).astype("float32"))
    loss = net(noisy).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_the_global_generator_reseeded_without_a_seed_is_named_and_its_fix_verified(
        tmp_path: Path) -> None:
    """Trial (normflows, round 12): ``np.random.seed(None)`` got the OpenCV recipe and no
    fix that worked; its line is now the unseeded generator's, its fix applied."""
    script = tmp_path / "train.py"
    script.write_text(GLOBAL_RESEEDED)
    result = run_cli("run", "-q", "--json", "r.json", str(script), cwd=tmp_path, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    first = report["suggestions"][0]
    assert first["id"] == "PY-NP-GENERATOR", [s["id"] for s in report["suggestions"]]
    assert first["verified"], first
    assert "train.py:5" in result.stdout, result.stdout
