"""Faults, eleventh round (FINDINGS.md), and the items left from the tenth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nondet import importpath
from tests.conftest import run_cli, tiny_training


@pytest.mark.parametrize("failure", [
    "AttributeError: module 'nondet' has no attribute 'helper'",
    "ImportError: cannot import name 'helper' from 'nondet' (/x/nondet/__init__.py)",
    "ModuleNotFoundError: No module named 'nondet.utils'",
])
def test_a_failure_reaching_for_the_scripts_own_nondet_module_gets_the_hint(
        failure: str) -> None:
    assert importpath.shadowed_hint(failure) == importpath.SHADOWED_HINT


@pytest.mark.parametrize("failure", [
    "AttributeError: module 'numpy' has no attribute 'helper'",
    "ModuleNotFoundError: No module named 'nondetx'",
    "RuntimeError: nondet step failed",
])
def test_other_failures_get_no_such_hint(failure: str) -> None:
    assert importpath.shadowed_hint(failure) == ""


@pytest.mark.e2e
def test_a_scripts_own_nondet_module_is_named_when_the_run_fails(tmp_path: Path) -> None:
    """Trial (faults round 10): a project's ``nondet.py`` beside the script is hidden by
    nondet's package, imported first in a recorded run; plain python runs the script.
    The failure said only "the script failed" with the AttributeError."""
    project = tmp_path / "project"  # not the working directory: ``python -m nondet`` there
    project.mkdir()  # would run the project's module itself, as Python does
    (project / "nondet.py").write_text("def helper():\n    return 3\n")
    (project / "train.py").write_text("import nondet\n" + tiny_training().replace(
        "torch.manual_seed(0)", "torch.manual_seed(nondet.helper())"))
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"),
                   str(project / "train.py"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    first = done.stderr.splitlines()[0]
    assert "module 'nondet' has no attribute 'helper'" in first, done.stderr
    assert importpath.SHADOWED_HINT in first, done.stderr


def test_a_zero_tensor_hashes_as_the_zeros_it_holds() -> None:
    """Forward-mode AD's zero tangents are efficient zero tensors: no memory (data_ptr 0),
    which NumPy refused inside the op recorder (exit 3 on every torch.func.jvp script)."""
    import torch

    from nondet.frameworks.torch import hostwords

    for shape, dtype in (((2, 3), torch.float32), ((5,), torch.float16), ((3,), torch.int8)):
        zero = torch._efficientzerotensor(shape, dtype=dtype)
        assert zero._is_zerotensor() and zero.data_ptr() == 0
        plain = torch.zeros(shape, dtype=dtype)
        assert hostwords.dense_cpu_content(zero) == hostwords.dense_cpu_content(plain)
        assert hostwords.raw_bytes(zero).tobytes() == hostwords.raw_bytes(plain).tobytes()


_JVP_TRAINING = """
import random
import torch
from torch.func import jvp
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Softplus(), torch.nn.Linear(16, 6))
opt = torch.optim.Adam(net.parameters(), 3e-3)
shift = random.Random()  # unseeded: enters at step 2
for step in range(4):
    z = torch.randn(8, 4) + (shift.random() if step == 2 else 0.0)
    _, tangent = jvp(lambda x: net(x), (z,), (torch.ones_like(z),))
    loss = net(z).pow(2).mean() + 1e-4 * tangent.pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.e2e
def test_forward_mode_ad_training_is_recorded_and_narrowed(tmp_path: Path) -> None:
    """Trial (PyTorch round 14): a loss with a ``torch.func.jvp`` term was nondet's
    internal error (exit 3) in every run; a difference entering at step 2 is now found
    there, through the op-level re-run that hashes the zero tangents."""
    (tmp_path / "train.py").write_text(_JVP_TRAINING)
    done = run_cli("run", "-q", "--no-verify", "--json", "r.json", "train.py", cwd=tmp_path,
                   timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    div = json.loads((tmp_path / "r.json").read_text())["first_divergence"]
    assert div["step"] == 2 and div["source"] == "train.py:10", div
