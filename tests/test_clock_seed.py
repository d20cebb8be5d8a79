"""A seed read from the clock names the line that read it (``clock.origin_of``,
``seeding``, ``seed_diff``): the finding's text says the seed came from the clock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from nondet import clock
from tests.conftest import run_cli

T = 1795454799.123456  # a wall-clock reading (seconds)
NS = 1795454812987654321  # another line, another second


@pytest.fixture
def reads() -> Iterator[None]:
    saved = dict(clock._READS)
    clock._READS.clear()
    clock._READS[("train.py", 4)] = (T, None)
    clock._READS[("train.py", 9)] = (NS / 1e9, NS)
    try:
        yield
    finally:
        clock._READS.clear()
        clock._READS.update(saved)


@pytest.mark.parametrize(("seed", "line", "how"), [
    (int(T), 4, "s"),
    (int(T * 1000) % 2**32, 4, "ms % 4294967296"),
    (int(T * 1e6) % 10**6, 4, "us % 1000000"),  # datetime.now().microsecond
    (T, 4, "seconds"),
    (NS, 9, "ns"),
    (NS % 2**32, 9, "ns % 4294967296"),
    (NS // 1000, 9, "us"),
])
def test_seeds_made_from_a_clock_reading_name_its_line(reads: None, seed: int | float,
                                                       line: int, how: str) -> None:
    assert clock.origin_of(seed) == ("train.py", line, how)


@pytest.mark.parametrize("seed", [0, 42, 1234, 4242424, 2**31 + 7, True, "1795454799"])
def test_other_seeds_are_not_called_clock_seeds(reads: None, seed: object) -> None:
    # constants, a pid, an os.urandom number, a string: never "from the clock"
    assert clock.origin_of(seed) is None


def test_only_the_users_own_readings_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clock, "_READS", {})
    monkeypatch.setattr(clock, "_is_user", lambda filename: filename == __file__)

    def shifted_time() -> None:  # the stand-in for time.time(): _note looks past it
        clock._note(T, None)

    def library_reads() -> None:  # a library reading the clock (logging, tqdm)
        shifted_time()

    library_reads.__code__ = library_reads.__code__.replace(co_filename="<library>")
    library_reads()
    assert clock.origin_of(int(T)) is None

    def user_line() -> None:
        shifted_time()

    user_line()
    found = clock.origin_of(int(T))
    assert found is not None and found[0] == __file__


_CLOCK_SEED = """
import time
import torch
seed = int(time.time() * 1000) % 2**32
torch.manual_seed(seed)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.e2e
def test_a_clock_seed_finding_names_the_clock_line(tmp_path: Path) -> None:
    """The seed finding stays at the seeding call; its text names the line that read the
    clock (before: only the seeding call and both values)."""
    (tmp_path / "train.py").write_text(_CLOCK_SEED)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", "train.py",
                     cwd=tmp_path, timeout=240)
    assert result.returncode == 1, result.stderr
    div = json.loads((tmp_path / "r.json").read_text())["first_divergence"]
    assert div["kind"] == "seed" and div["source"] == "train.py:5", div
    assert any(n.startswith("the seed was read from the clock at train.py:4 "
                            "(seed = int(time.time() * 1000) % 2**32)")
               for n in div["notes"]), div["notes"]


_SAMPLED_AFTER_TRAINING = """
import time
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8)
for step in range(3):
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
g = torch.Generator().manual_seed(int(time.time() * 1000) % 2**32)
with torch.no_grad():
    samples = model(torch.randn(8, 8, generator=g))
"""


@pytest.mark.e2e
def test_a_generator_seeded_from_the_clock_after_training_is_noted(tmp_path: Path) -> None:
    """Trial (round 12: sampling after training, diffusers' DDPM pipeline): training
    repeats, the samples drawn afterwards do not. That was "deterministic" without a word;
    the verdict stays (training repeated), with a note naming the seeding call and the
    clock line."""
    (tmp_path / "train.py").write_text(_SAMPLED_AFTER_TRAINING)
    result = run_cli("run", "-q", "--json", "r.json", "train.py", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    notes = [n for n in report["notes"] if n.startswith("after the last training step")]
    assert len(notes) == 1, report["notes"]
    assert "torch.Generator.manual_seed received" in notes[0] and "train.py:11" in notes[0]
    assert any("the seed was read from the clock at train.py:11" in n
               for n in report["notes"]), report["notes"]


_SOBOL_CLOCK = """
import time
import torch
torch.manual_seed(0)
pool = torch.quasirandom.SobolEngine(4, scramble=True, seed=int(time.time())).draw(64)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    loss = model(pool[step * 16:(step + 1) * 16]).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.e2e
def test_a_clock_seed_handed_to_a_torch_api_is_the_finding_and_its_fix_verified(
        tmp_path: Path) -> None:
    """Trial (round 13): ``SobolEngine(seed=int(time.time()))`` seeds torch's generator
    with the user's clock reading inside torch. The finding was the first random op, with
    ``torch.manual_seed`` as its fix, which cannot help; it is now the seed at the script's
    line, from the clock, and pinning it is verified."""
    (tmp_path / "train.py").write_text(_SOBOL_CLOCK)
    result = run_cli("run", "-q", "--json", "r.json", "train.py", cwd=tmp_path, timeout=400)
    assert result.returncode == 1, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    div = report["first_divergence"]
    assert div["kind"] == "seed" and div["source"] == "train.py:5", div
    assert any("the seed was read from the clock at train.py:5" in n for n in div["notes"])
    first = report["suggestions"][0]
    assert first["id"] == "PY-SEED-VARIES" and first["verified"] is True, first
