"""A difference only the final parameters show: the script changes them after its last
recorded step (trial round 20: torchopt's functional adam after a MAML phase)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.conftest import run_cli

AFTER_THE_LAST_STEP = """
    import numpy as np
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    for step in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # after the last step: no step boundary follows
        for p in model.parameters():
            p.add_(torch.from_numpy(np.random.default_rng().normal(0, 1e-3, p.shape)
                                    .astype("float32")))
    print(float(model.weight.sum()))
    """


def test_a_difference_after_the_last_step_has_no_table_of_identical_steps(
        tmp_path: Path) -> None:
    """Found ("final params differ", exit 1), with the note that every recorded step was
    identical; the growth table listed the identical steps before the last one."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(AFTER_THE_LAST_STEP))
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert any("every recorded step was identical" in n
               for n in report["first_divergence"]["notes"] + report["notes"]), report
    assert report["growth"] == []
