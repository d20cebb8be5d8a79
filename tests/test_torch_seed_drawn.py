"""``torch.seed()`` and ``Generator.seed()`` draw a seed from the OS: the call that drew it
is named, with a fix that pins it (a trial's scripts were told to add the
``torch.manual_seed`` they already had, at the top)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

SCRIPT = """\
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 8)
gen = torch.Generator().manual_seed(1)
if sys.argv[1] == "global":
    torch.seed()  # line 9
else:
    gen.seed()  # line 11
for step in range(4):
    noise = torch.randn(x.shape, generator=gen)
    loss = (model(x + noise) - 1).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize(("how", "line", "api"), [("global", 9, "torch.seed"),
                                                  ("generator", 11, "torch.Generator.seed")])
def test_a_drawn_seed_is_named_and_pinned(tmp_path: Path, how: str, line: int,
                                         api: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = run_cli("run", "-q", "--json", str(tmp_path / "r.json"), "--out",
                   str(tmp_path / "out"), str(script), how, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    div = report["first_divergence"]
    assert div["source"].endswith(f"train.py:{line}") and api in done.stdout
    # round 12: it takes no seed, it draws one ("received a different seed" said otherwise)
    assert f"{api} drew a different seed" in done.stdout, done.stdout
    assert div["notes"][0].startswith(f"{api} drew "), div["notes"]
    first = report["suggestions"][0]
    assert first["id"] == "PY-SEED-VARIES" and first["verified"] is True
