"""The script's own draws from Python's global ``random`` before it seeds it, or with no
seeding at all (``pyhooks._watch_python_draws``, ``early_draws.PYTHON_GLOBAL``): nondet
seeds that generator in both runs, so they repeat where the script's plain runs draw
fresh values each time; the verdict stays theirs and a note says so
(``seed_diff.unseeded_script_notes``). Found on pytorch/examples' siamese_network (a
``random.randint`` in ``__getitem__``, never seeded) and dcgan (its seed drawn with
``random.randint`` before ``random.seed``): "deterministic" with no word."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from nondet import seed_diff
from tests.frameworks.test_tf_capture import line_of, run_script

BODY = """
import random
import email.utils
import torch
torch.manual_seed(0)
email.utils.make_msgid()  # a library's own draw (the standard library): not the script's
SEEDING
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), 0.1)
for step in range(3):
    k = random.randint(0, 9)  # DRAW
    loss = (model(torch.full((2, 4), float(k))) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("restored:", random.randint == random._inst.randint)
"""


def _notes(tmp_path: Path, seeding: str) -> tuple[list[str], str]:
    capture, result = run_script(tmp_path, BODY.replace("SEEDING", seeding), header="")
    return seed_diff.unseeded_script_notes(capture), result.log_tail()


def test_a_script_that_draws_and_never_seeds_python_is_told(tmp_path: Path) -> None:
    notes, log = _notes(tmp_path, "")
    draw = f"train.py:{line_of(tmp_path, '# DRAW')}"
    assert [n for n in notes if "Python's random" in n] == [
        next(n for n in notes if n.startswith(f"at {tmp_path / draw} the script draws from "
                                               "Python's random module and never seeds it"))]
    assert "restored: True" in log  # once recorded, the module's functions are its own


def test_a_draw_before_the_scripts_seeding_call_is_told_with_that_call(tmp_path: Path) -> None:
    notes, _ = _notes(tmp_path, "seed = random.randint(1, 10000)  # EARLY\nrandom.seed(seed)")
    early = f"train.py:{line_of(tmp_path, '# EARLY')}"
    python = [n for n in notes if "Python's random" in n]
    assert len(python) == 1 and python[0].startswith(f"at {tmp_path / early} ")
    assert "before the script seeds it (random.seed at" in python[0]


def test_a_script_that_seeds_python_first_is_told_nothing(tmp_path: Path) -> None:
    notes, log = _notes(tmp_path, "random.seed(1)")
    assert not [n for n in notes if "Python's random" in n]
    assert "restored: True" in log


NUMPY_BODY = """
import numpy as np
import torch
torch.manual_seed(0)
SEEDING
order = np.random.permutation(8)  # DRAW
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), 0.1)
for step in range(3):
    np.random.shuffle(order)
    loss = (model(torch.full((2, 4), float(order[0]))) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("restored:", np.random.shuffle == np.random.mtrand._rand.shuffle)
"""


def _numpy_notes(tmp_path: Path, seeding: str) -> tuple[list[str], str]:
    capture, result = run_script(tmp_path, NUMPY_BODY.replace("SEEDING", seeding), header="")
    return ([n for n in seed_diff.unseeded_script_notes(capture) if "NumPy's global" in n],
            result.log_tail())


def test_a_script_that_draws_from_numpys_global_generator_and_never_seeds_it_is_told(
        tmp_path: Path) -> None:
    """Trial (PyTorch round 14): ``torch.manual_seed(0)`` only, then ``np.random.permutation``
    and ``np.random.shuffle`` (plain runs: 3 digests in 3) was "deterministic" with no word,
    while the same script with Python's ``random`` got its note."""
    notes, log = _numpy_notes(tmp_path, "")
    draw = f"train.py:{line_of(tmp_path, '# DRAW')}"
    assert len(notes) == 1 and notes[0].startswith(
        f"at {tmp_path / draw} the script draws from NumPy's global random generator"), notes
    assert "call np.random.seed(0)" in notes[0]
    assert "restored: True" in log  # once recorded, the module's functions are its own


def test_numpy_draws_after_the_scripts_own_seed_are_told_nothing(tmp_path: Path) -> None:
    notes, _ = _numpy_notes(tmp_path, "np.random.seed(3)")
    assert notes == []


def test_a_global_state_the_script_sets_is_its_seeding(tmp_path: Path) -> None:
    """Trial round 20 (ctgan): ``@random_state`` sets NumPy's global state from its
    ``set_random_state(0)`` generator around ``fit`` (``np.random.set_state``), and the
    script was told it "draws from NumPy's global random generator and never seeds it";
    its plain runs repeat."""
    notes, _ = _numpy_notes(tmp_path,
                            "np.random.set_state(np.random.RandomState(0).get_state())")
    assert notes == []


def test_a_numpy_draw_before_the_scripts_seed_is_told_with_that_call(tmp_path: Path) -> None:
    notes, _ = _numpy_notes(tmp_path, "seed = int(np.random.randint(1, 100))  # EARLY\n"
                                      "np.random.seed(seed)")
    early = f"train.py:{line_of(tmp_path, '# EARLY')}"
    assert len(notes) == 1 and notes[0].startswith(f"at {tmp_path / early} "), notes
    assert "before the script seeds it (np.random.seed at" in notes[0]
