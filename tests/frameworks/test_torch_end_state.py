"""What a torch script changes after its last step: the saved buffers count, not only the
parameters (``torch.optim.swa_utils.update_bn`` recomputes BatchNorm statistics after
training; a trial found such a script "deterministic" while its plain runs differed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli

SCRIPT = """
    import sys
    import time
    import numpy as np
    import torch
    from torch.optim.swa_utils import AveragedModel, update_bn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model.register_buffer("last_seen", torch.zeros(()), persistent=False)
    swa = AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 8)
    for step in range(4):
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        swa.update_parameters(model)
    model.last_seen.fill_(time.time())  # scratch, not saved: no difference to report
    rng = np.random.default_rng(0 if "--seeded" in sys.argv else None)
    jitter = [x + torch.from_numpy(rng.normal(0, 0.1, x.shape).astype("float32"))]
    update_bn(jitter, swa)
    """


@pytest.mark.parametrize("seeded", [True, False])
def test_buffers_recomputed_after_the_last_step(tmp_path: Path, seeded: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    args = ["--seeded"] if seeded else []
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), str(script),
                   *args, cwd=tmp_path)
    if seeded:
        assert done.returncode == 0, done.stdout + done.stderr
        return
    assert done.returncode == 1, done.stdout + done.stderr
    assert "final buffers differ" in done.stdout and "update_bn" in done.stdout


EMA = """
    import sys
    import numpy as np
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 8)
    rng = np.random.default_rng(0 if "--seeded" in sys.argv else None)
    for step in range(4):
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        # the average of a perturbed copy (what an EMA thread racing opt.step reads)
        perturbed = torch.nn.Linear(8, 4)
        with torch.no_grad():
            for p, q in zip(perturbed.parameters(), model.parameters()):
                p.copy_(q + torch.from_numpy(rng.normal(0, 1e-3, q.shape).astype("float32")))
        ema.update_parameters(perturbed)
    """


@pytest.mark.parametrize("seeded", [True, False])
def test_an_averaged_model_never_called_is_compared_at_the_end(tmp_path: Path,
                                                               seeded: bool) -> None:
    """An EMA (``AveragedModel``) the script only updates and saves: a trial's, updated in
    a thread racing ``opt.step``, ended with other weights in each plain run and nondet said
    "deterministic" (here: the difference was a note, "never reached training")."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(EMA))
    args = ["--seeded"] if seeded else []
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), str(script),
                   *args, cwd=tmp_path)
    assert done.returncode == (0 if seeded else 1), done.stdout + done.stderr
    if not seeded:  # the end state differs: the value that made it is the finding
        assert "train.py:20" in done.stdout and "PY-NP-GENERATOR" in done.stdout
