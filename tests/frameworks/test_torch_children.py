"""The child side of recorded child processes (frameworks/torch/children.py): nondet's own
failure to record a child never reaches the user's program."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

pytest.importorskip("torch")

from nondet import session as session_module
from nondet.frameworks.torch import children


def _config(children_dir: Path) -> dict[str, object]:
    return {"label": "a.child0", "seed": 0, "channel_fd": -1, "control_fd": -1,
            "script": None, "module": None, "args": [], "op_steps": None,
            "children_dir": str(children_dir), "forked": True}


def double(x: int) -> int:
    return 2 * x


def test_a_child_whose_recording_cannot_start_runs_its_target_as_is(tmp_path: Path) -> None:
    main = children.ChildMain(double, _config(tmp_path / "no such directory"))
    assert main(21) == 42
    assert session_module.current() is None
    assert list(tmp_path.iterdir()) == []


def test_the_wrapped_target_survives_pickling_for_a_spawned_child(tmp_path: Path) -> None:
    main = pickle.loads(pickle.dumps(children.ChildMain(double, _config(tmp_path / "gone"))))
    assert main.target is double and main(4) == 8


def test_a_lazy_module_handed_to_a_child_is_state_once_materialized() -> None:
    """A ``LazyLinear`` handed to a child before its first call: its parameters hold no
    values yet (any read raises), so they are not the tensors the child may change; the
    start hook read them and nondet failed (exit 3, round 7)."""
    import torch

    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 1))
    found = children._tensors_in([model, {"x": torch.ones(2)}, torch.empty(2, device="meta")])
    assert [tuple(t.shape) for t in found] == [(1, 4), (1,), (2,)]
