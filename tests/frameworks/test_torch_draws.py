"""The first draw from torch's default generator before the script seeds it
(``frameworks/torch/draws.py``) and the note it becomes (``seed_diff``)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from nondet import seed_diff
from nondet import session as session_module

torch = pytest.importorskip("torch")
from nondet.frameworks.torch import draws  # noqa: E402  (after the importorskip)

SEED = 1234
_STARTED: list[Any] = []


class _Session:
    """What the watch uses of the child's session: facts out, the user's line, step ends."""

    def __init__(self, fail: bool = False) -> None:
        self.facts: dict[str, Any] = {}
        self.step_listeners: list[Any] = []
        # the innermost user frame is "train.py:7", the outermost (this file's) "train.py:30"
        self.sources = SimpleNamespace(here=lambda depth=2: 0, user_file=lambda f: f == __file__,
                                       intern_location=lambda f, line: 1)
        self.fail = fail

    def send_facts(self, facts: dict[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("the pipe is gone")
        self.facts.update(facts)

    def string(self, sid: int) -> str:
        return ["train.py:7", "train.py:30"][sid]


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh watch on a fake session; torch's seeding functions put back afterwards."""
    def start(fail: bool = False) -> tuple[_Session, draws.DrawWatch]:
        for owner, name in draws._SEEDING:
            monkeypatch.setattr(owner, name, getattr(owner, name))
        session = _Session(fail)
        _STARTED.append(session)
        monkeypatch.setattr(session_module, "_CURRENT", session)
        torch.manual_seed(SEED)  # nondet's own seeding, before the watch starts
        watch = draws.install(session, SEED, contextlib.nullcontext)  # type: ignore[arg-type]
        assert watch is not None
        return session, watch

    depth = torch._C._len_torch_function_stack()
    yield start
    # a mode cannot leave the stack from inside its own handler: it goes at the next step
    # end, the init row's at the latest (and passes every call through until then)
    for listener in _STARTED[-1].step_listeners:
        listener(-1)
    assert torch._C._len_torch_function_stack() == depth


def test_a_model_built_before_seeding_is_named(watched: Any) -> None:
    depth = torch._C._len_torch_function_stack()
    session, watch = watched()
    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(3))  # the first module call takes the mode off the stack
    assert torch._C._len_torch_function_stack() == depth
    assert session.facts[draws.FACT] == {"site": "train.py:7", "op": "kaiming_uniform_",
                                         "from": "train.py:30"}
    assert not watch.watching


@pytest.mark.parametrize("seed_first", [
    lambda: torch.manual_seed(0),
    lambda: torch.random.manual_seed(SEED),  # nondet's own value: the call still counts
    lambda: torch.set_rng_state(torch.get_rng_state()),  # a resumed checkpoint's state
])
def test_seeding_first_is_silent(watched: Any, seed_first: Any) -> None:
    session, watch = watched()
    torch.zeros(3).sum()  # not a draw
    seed_first()
    torch.nn.Linear(3, 2)
    torch.randn(4)
    assert draws.FACT not in session.facts and not watch.watching


def test_unwrapped_seeding_is_silent(watched: Any) -> None:
    session, _ = watched()
    torch.default_generator.manual_seed(5)  # a C method nondet cannot wrap
    torch.nn.Linear(3, 2)
    assert draws.FACT not in session.facts


def test_no_draw_keeps_watching_until_training_starts(watched: Any) -> None:
    session, watch = watched()
    torch.nn.functional.dropout(torch.ones(4), training=False)  # eval dropout draws nothing
    torch.randn(2, generator=torch.Generator().manual_seed(1))  # its own generator
    assert watch.watching and draws.FACT not in session.facts
    for listener in session.step_listeners:
        listener(-1)  # the init row: training starts
    assert not watch.watching


def test_trouble_never_reaches_the_script(watched: Any) -> None:
    _, watch = watched(fail=True)
    assert torch.nn.Linear(3, 2).weight.shape == (2, 3)
    assert not watch.watching


def _capture(facts: dict[str, Any]) -> Any:
    return SimpleNamespace(facts={"framework": "torch", **facts})


def test_the_note_names_the_draw_and_the_first_seeding_call() -> None:
    seeded = {"seed#0": {"api": "torch.manual_seed", "site": "train.py:9", "library": "",
                         "package": "", "calls": [[3, -1, "0"]]}}
    draw = {draws.FACT: {"site": "train.py:7", "op": "uniform_", "from": "train.py:8"}}
    [note] = seed_diff.unseeded_script_notes(_capture({**draw, **seeded}))
    assert note.startswith("train.py:7 draws") and "first seeding call (train.py:9)" in note
    assert "called from train.py:8" in note
    assert "[PT-RNG]" in note
    [never] = seed_diff.unseeded_script_notes(_capture(draw))
    assert "never seeds torch" in never
    assert seed_diff.unseeded_script_notes(_capture(seeded)) == []
    assert seed_diff.unseeded_script_notes(_capture({draws.FACT: "junk"})) == []
