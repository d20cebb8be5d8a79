"""How a run's step loop ended (``nondet/loop_end.py``): the ``break`` that ended training
early while the script went on, named by the ``structure`` finding."""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nondet import loop_end
from tests.conftest import run_cli

_LOOPS = """
for epoch in range(3):          # 2
    for i in range(5):          # 3
        step()                  # 4
        if i == 2:              # 5
            break               # 6
    if done():                  # 7
        break                   # 8
    def helper():               # 9
        for j in range(2):      # 10
            pass                # 11
    else_ok = 1                 # 12
while cond():                   # 13
    if x: return                # 14
    work()                      # 15
"""


def test_the_loop_of_a_line_is_the_innermost_of_its_scope_with_its_own_breaks() -> None:
    tree = ast.parse(textwrap.dedent(_LOOPS).replace("return", "pass"))
    inner = loop_end.loop_at(tree, 4)
    assert inner is not None and (inner.header, inner.body_end, inner.breaks) == (3, 6, (6,))
    outer = loop_end.loop_at(tree, 7)
    # the inner loop's break leaves the inner loop only
    assert outer is not None and (outer.header, outer.kind, outer.breaks) == (2, "for", (8,))
    nested = loop_end.loop_at(tree, 11)  # a function's loop, not the loop it is defined in
    assert nested is not None and nested.header == 10
    w = loop_end.loop_at(tree, 15)
    assert w is not None and (w.kind, w.header) == ("while", 13)
    assert loop_end.loop_at(tree, 1) is None


class _Sources:
    def user_file(self, filename: str) -> bool:
        return filename == __file__

    def intern_location(self, filename: str, line: int) -> int:
        return line


class _Session:
    """What the watch uses of a Session: sources, strings, facts and step listeners."""

    def __init__(self) -> None:
        self.sources = _Sources()
        self.step_listeners: list[Callable[[int], None]] = []
        self.facts: dict[str, Any] = {}
        self.meta: list[dict[str, Any]] = []

    def string(self, sid: int) -> str:
        return f"test_loop_end.py:{sid}"

    def send_facts(self, facts: dict[str, Any]) -> None:
        self.facts.update(facts)

    def send_meta(self, meta: dict[str, Any]) -> None:
        self.meta.append(meta)


@pytest.fixture
def session() -> Iterator[_Session]:
    # pytest-cov or a debugger may trace the test itself: the watch stays away from a
    # script's own trace function, so the test runs without one and puts it back after
    previous = sys.gettrace()
    sys.settrace(None)
    s = _Session()
    loop_end.install(s)  # type: ignore[arg-type]
    try:
        yield s
    finally:
        loop_end._forget()
        sys.settrace(previous)


# the step end as a library calls it (optimizer.step -> nondet -> listeners): not user code
_LIBRARY: dict[str, Any] = {}
exec(compile("def step_end(session, step):\n    for listener in session.step_listeners:\n"
             "        listener(step)\n", "<library>", "exec"), _LIBRARY)
_step_end: Callable[[_Session, int], None] = _LIBRARY["step_end"]


def _train(session: _Session, stop_at: int, how: str) -> int:
    done = 0
    for step in range(5):
        _step_end(session, step)  # the step ends here (optimizer.step)
        done += 1
        if how == "break" and step == stop_at:
            break
        if how == "return" and step == stop_at:
            return done
    return done


def _line_of(text: str) -> int:
    lines, start = inspect.getsourcelines(_train)
    return start + next(i for i, line in enumerate(lines) if line.strip() == text)


def test_a_break_after_the_step_is_named_with_its_loop(session: _Session) -> None:
    assert _train(session, 2, "break") == 3
    loop_end.send(session)  # type: ignore[arg-type]
    fact = session.facts[loop_end.LOOP_FACT]
    assert fact["how"] == "break", fact
    assert fact["source"] == f"test_loop_end.py:{_line_of('break')}"
    assert fact["loop"] == f"test_loop_end.py:{_line_of('for step in range(5):')}"
    assert sys.gettrace() is None and not session.meta  # nothing left tracing, no error


def test_a_loop_that_ran_out_and_a_return_are_told_apart(session: _Session) -> None:
    _train(session, -1, "none")
    loop_end.send(session)  # type: ignore[arg-type]
    assert session.facts[loop_end.LOOP_FACT]["how"] == "for loop's end"
    _train(session, 1, "return")
    loop_end.send(session)  # type: ignore[arg-type]
    fact = session.facts[loop_end.LOOP_FACT]
    returned = f"test_loop_end.py:{_line_of('return done')}"
    assert (fact["how"], fact["source"]) == ("return", returned)


def test_a_break_while_paused_names_the_loop_and_its_exits(session: _Session) -> None:
    for step in range(5):
        _step_end(session, step)
        loop_end.pause()  # the model's forward starts
        if step == 1:
            break
    loop_end.send(session)  # type: ignore[arg-type]
    fact = session.facts[loop_end.LOOP_FACT]
    assert fact["how"] == "unseen" and "break at test_loop_end.py:" in fact["exits"], fact
    assert sys.gettrace() is None


def test_a_script_that_traces_itself_is_left_alone(session: _Session) -> None:
    def own(frame: Any, event: str, arg: Any) -> None:
        return None

    sys.settrace(own)
    try:
        _train(session, 2, "break")
        assert sys.gettrace() is own
    finally:
        sys.settrace(None)
    loop_end.send(session)  # type: ignore[arg-type]
    assert loop_end.LOOP_FACT not in session.facts


_BREAKS_IN_SECOND = """
import os, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def first_here():
    try:
        os.close(os.open("done-early", os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False

for step in range(5):  # line 14
    loss = model(torch.ones(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 1 and not first_here():
        break  # line 18
print("the script goes on")
"""


@pytest.mark.e2e
def test_a_run_that_breaks_out_early_names_the_break(tmp_path: Path) -> None:
    """The run that comes second leaves its loop at step 1: the finding names the break
    (it named no line before)."""
    (tmp_path / "train.py").write_text(_BREAKS_IN_SECOND)
    result = run_cli("run", "-q", "--json", "r.json", "train.py", cwd=tmp_path, timeout=240)
    assert result.returncode == 1, result.stderr
    div = json.loads((tmp_path / "r.json").read_text())["first_divergence"]
    assert div["kind"] == "structure" and div["source"] == "train.py:18", div
    assert "ended after 2 steps at the break in train.py:18 (the loop at train.py:14)" \
        in result.stdout, result.stdout


def test_a_line_that_calls_a_librarys_loop_is_not_watched(session: _Session) -> None:
    """``for lr in lrs: model.fit(...)``: the user's loop is not the one driving the steps;
    after a few step ends without a line of its own the frame is left alone."""
    def fit(steps: int) -> None:  # a library's training loop
        for step in range(steps):
            _step_end(session, step)

    fit.__code__ = fit.__code__.replace(co_filename="<library>")
    for _ in range(2):
        fit(6)
    loop_end.send(session)  # type: ignore[arg-type]
    assert loop_end.LOOP_FACT not in session.facts  # its loop is unknown: nothing said
    assert loop_end._WATCH is not None and len(loop_end._WATCH.not_loops) == 1
