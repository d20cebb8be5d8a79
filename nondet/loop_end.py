"""Where a run's step loop ended: the ``break`` (or loop condition, ``return``) that ended
training when the script itself went on (``if loss < thr: break``, a time budget).

``exit_place`` names a ``sys.exit``/``os._exit`` line; a plain ``break`` leaves no trace
once the loop is over, so it has to be watched while it happens. Child side: at every step
end (``Session.step_listeners``) the watch finds the user's frame whose current line lies
inside a ``for``/``while`` loop (the loop that drives the steps, found in the file's AST) and
traces that one frame's lines (``frame.f_trace``) until the next step's heavy work begins:
the framework calls ``pause()`` around model calls, backward and the optimizer and
``resume()`` after. The first line of that frame outside the loop marks the exit; the line
run just before it is the exit's line. At the script's normal end ``send`` puts the last
exit seen (after the last step) into the capture as ``LOOP_FACT``; if the exit happened
where the watch was paused, the fact names the loop and every exit it has, not one.

Cost: nothing per op; Python's trace hook is on only between the step end and the next
model call (the loop's own lines and the data fetch), at most ``MAX_CALLS`` nested calls
per step, and never when the script (a debugger, coverage) has its own trace function.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import threading
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nondet.session import Session
    from nondet.store import Capture

LOOP_FACT = "script.loop_ended"
#: Nested Python calls traced per step before the watch gives up for that step (bounds its
#: cost when the loop runs a lot of Python between steps without a model call).
MAX_CALLS = 5000
#: Step ends in a row at one line of a frame that ran nothing in between: a library's loop.
_STILL_STEPS = 3
#: Frames walked up from the step end to find the loop (hooks, optimizer, helpers).
_MAX_DEPTH = 64


@dataclass(frozen=True)
class Loop:
    """One ``for``/``while`` statement of a user's file (lines are 1-based, inclusive)."""

    header: int  # the ``for``/``while`` line
    body_end: int  # last line of its body (an ``else:`` clause is outside: the loop ran out)
    kind: str  # "for" or "while"
    breaks: tuple[int, ...]  # lines of the ``break``s that leave this loop
    returns: tuple[int, ...]  # lines of ``return``/``raise`` statements inside it

    def inside(self, line: int) -> bool:
        return self.header <= line <= self.body_end


# -- finding the loop (AST, cached per file) -----------------------------------------------------
_TREES: dict[str, ast.Module | None] = {}
_LOOPS: dict[tuple[CodeType, int], Loop | None] = {}


def _tree(filename: str) -> ast.Module | None:
    if filename not in _TREES:
        try:  # linecache: the text tracebacks show (and no open the readback hook sees)
            _TREES[filename] = ast.parse("".join(linecache.getlines(filename)), filename)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            _TREES[filename] = None
    return _TREES[filename]


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_LOOPS_T = (ast.For, ast.AsyncFor, ast.While)


def loop_at(tree: ast.AST, line: int) -> Loop | None:
    """The innermost loop of the innermost scope (function, class, module) holding ``line``
    in its body: the loop a frame stopped at ``line`` is iterating."""
    found: ast.AST | None = None
    node: ast.AST = tree
    while True:
        inner = next((c for c in ast.iter_child_nodes(node)
                      if isinstance(c, ast.stmt | ast.Lambda)
                      and c.lineno <= line <= (c.end_lineno or c.lineno)), None)
        if inner is None:
            break
        if isinstance(inner, _SCOPES):
            found = None  # a function defined inside a loop runs in a frame of its own
        elif isinstance(inner, _LOOPS_T) and inner.body and \
                inner.lineno <= line <= (inner.body[-1].end_lineno or inner.lineno):
            found = inner
        node = inner
    return _describe(found) if found is not None else None


def _describe(loop: ast.AST) -> Loop:
    assert isinstance(loop, _LOOPS_T)
    breaks: list[int] = []
    returns: list[int] = []

    def visit(node: ast.AST, own: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _SCOPES):
                continue
            if isinstance(child, ast.Break) and own:
                breaks.append(child.lineno)
            elif isinstance(child, ast.Return | ast.Raise):
                returns.append(child.lineno)
            # a break inside a nested loop leaves that loop, not this one (its else too)
            visit(child, own and not isinstance(child, _LOOPS_T))

    for stmt in loop.body:
        visit(ast.Module(body=[stmt], type_ignores=[]), True)
    return Loop(header=loop.lineno, body_end=loop.body[-1].end_lineno or loop.lineno,
                kind="while" if isinstance(loop, ast.While) else "for",
                breaks=tuple(sorted(set(breaks))), returns=tuple(sorted(set(returns))))


def _loop_of(frame: FrameType) -> Loop | None:
    key = (frame.f_code, frame.f_lineno)
    if key not in _LOOPS:
        tree = _tree(frame.f_code.co_filename)
        _LOOPS[key] = loop_at(tree, frame.f_lineno) if tree is not None else None
    return _LOOPS[key]


# -- the watch (child side) -------------------------------------------------------------------
class Watch:
    """One run's watch over the frame that drives its steps."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.thread: int | None = None
        self.frame: FrameType | None = None  # held only while armed (released at the exit)
        self.loop: Loop | None = None
        self.filename = ""
        self.last_inside = 0
        self.calls = 0
        self.paused = False
        self.exit: dict[str, str] | None = None  # the exit seen after the last step
        self.disabled = False
        self.moved = False  # the frame ran a line of its own since it was armed
        self.armed_at: tuple[int, int] | None = None
        self.still = 0  # step ends in a row at the same frame and line without moving
        self.not_loops: set[tuple[CodeType, int]] = set()

    # step end: arm on the loop's frame
    def step_ended(self, step: int) -> None:
        if self.disabled:
            return
        try:
            self._stop()
            self.exit = None
            frame = self._driving_frame()
            if (frame is None or sys.gettrace() is not None or frame.f_trace is not None
                    or self._library_driven(frame)):
                self.loop = None  # unknown loop (or the script traces itself): say nothing
                return
            self.frame, self.loop, self.moved = frame, _loop_of(frame), False
            self.filename = frame.f_code.co_filename
            self.last_inside, self.calls, self.paused = frame.f_lineno, 0, False
            self.thread = threading.get_ident()
            frame.f_trace_lines = True
            frame.f_trace = self._local
            sys.settrace(self._global)
        except Exception:
            self._failed()

    def _library_driven(self, frame: FrameType) -> bool:
        """The frame ran no line of its own between step ends, several times over: its line
        calls a library's loop (``model.fit``, ``trainer.train()`` inside a sweep), which
        drives the steps; that loop is not watched (it would only cost)."""
        key = (frame.f_code, frame.f_lineno)
        if key in self.not_loops:
            return True
        armed, self.armed_at = self.armed_at, (id(frame), frame.f_lineno)
        self.still = self.still + 1 if armed == self.armed_at and not self.moved else 0
        if self.still >= _STILL_STEPS:  # (two optimizers stepped on one line: once still)
            self.not_loops.add(key)
            return True
        return False

    def _driving_frame(self) -> FrameType | None:
        sources = self.session.sources
        frame: FrameType | None = sys._getframe(1)
        for _ in range(_MAX_DEPTH):
            if frame is None:
                return None
            if sources.user_file(frame.f_code.co_filename) and _loop_of(frame) is not None:
                return frame
            frame = frame.f_back
        return None

    # the trace functions: cheap, and never raising into the script
    def _global(self, frame: FrameType, event: str, arg: Any) -> None:
        self.calls += 1
        if self.calls > MAX_CALLS:
            self._give_up()
        return None  # no other frame is traced

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        try:
            loop = self.loop
            if frame is not self.frame or loop is None:
                return None
            if event == "line":
                line = frame.f_lineno
                self.moved = True
                if loop.inside(line):
                    self.last_inside = line
                    return self._local
                self._exited(self.last_inside)
                return None
            if event == "return" and loop.inside(frame.f_lineno):
                self._exited(frame.f_lineno)
                return None
            return self._local
        except Exception:
            self._failed()
            return None

    def _exited(self, line: int) -> None:
        loop = self.loop
        assert loop is not None
        how = ("break" if line in loop.breaks else "return" if line in loop.returns
               else f"{loop.kind} loop's end" if line == loop.header else "loop exit")
        self.exit = {"how": how, "source": self._shown(line), "loop": self._shown(loop.header)}
        self._stop()
        self.loop = None  # seen: nothing left to say until the next step

    def _shown(self, line: int) -> str:
        sid = self.session.sources.intern_location(self.filename, line)  # text goes along
        return self.session.string(sid)

    # the framework's heavy work: model calls, backward, optimizer
    def pause(self) -> None:
        if self.frame is not None and not self.paused and self._ours():
            self.paused = True
            sys.settrace(None)

    def resume(self) -> None:
        if self.frame is not None and self.paused and sys.gettrace() is None \
                and threading.get_ident() == self.thread:
            self.paused = False
            sys.settrace(self._global)

    def _ours(self) -> bool:
        return threading.get_ident() == self.thread and sys.gettrace() == self._global

    def _give_up(self) -> None:
        self._stop()  # the loop stays known: ``send`` names its exits

    def _stop(self) -> None:
        if self.frame is not None:
            if self.frame.f_trace == self._local:  # a tracer the script set since is its own
                self.frame.f_trace = None
            self.frame = None  # never keep the script's frame (and its locals) alive
        if sys.gettrace() == self._global:
            sys.settrace(None)
        self.paused = False

    def _failed(self) -> None:
        """nondet's own error: reported once as a nondet bug (exit 3); the script runs on."""
        import traceback

        from nondet import channel

        self.disabled = True
        self.loop = None
        try:
            self._stop()
        finally:
            self.session.send_meta({channel.META_HOOK_ERROR: traceback.format_exc()})

    def fact(self) -> dict[str, str] | None:
        """What is known of how the loop of the last step ended (None: no loop known)."""
        if self.exit is not None:
            return self.exit
        loop = self.loop
        if loop is None or not self.filename:
            return None
        exits = [f"break at {self._shown(n)}" for n in loop.breaks]
        exits += [f"return/raise at {self._shown(n)}" for n in loop.returns]
        exits.append(f"the {loop.kind} loop's end")
        return {"how": "unseen", "source": self._shown(loop.header),
                "loop": self._shown(loop.header), "exits": "; ".join(exits)}


_WATCH: Watch | None = None


def install(session: Session) -> None:
    """Watch the step loop of this run (boot.py, once)."""
    global _WATCH
    watch = _WATCH = Watch(session)
    session.step_listeners.append(watch.step_ended)
    os.register_at_fork(after_in_child=_forget)


def _forget() -> None:
    # a forked child (DataLoader worker) must not go on tracing with the parent's watch
    global _WATCH
    if _WATCH is not None and sys.gettrace() == _WATCH._global:
        sys.settrace(None)
    _WATCH = None


def pause() -> None:
    """The framework starts heavy work (a model call, backward, the optimizer)."""
    if _WATCH is not None and _WATCH.frame is not None:
        _WATCH.pause()


def resume() -> None:
    """The framework's heavy work is over: the loop's own lines run again."""
    if _WATCH is not None and _WATCH.frame is not None:
        _WATCH.resume()


def send(session: Session) -> None:
    """The script ended normally: record how the loop of its last step ended, if known."""
    watch = _WATCH
    if watch is None or watch.session is not session or watch.disabled:
        return
    try:
        watch._stop()
        fact = watch.fact()
        if fact is not None:
            session.send_facts({LOOP_FACT: fact})
    except Exception:
        watch._failed()


# -- parent side --------------------------------------------------------------------------------
def ended_at(capture: Capture) -> tuple[str, str] | None:
    """(source, phrase) of how this run's step loop ended, if recorded: ("train.py:27",
    "at the break in train.py:27 (the loop at train.py:20)")."""
    fact = capture.facts.get(LOOP_FACT)
    if not isinstance(fact, dict):
        return None  # not recorded, or a (crafted) capture holding something else
    how, source, loop = (fact.get(k) for k in ("how", "source", "loop"))
    if not (isinstance(how, str) and isinstance(source, str) and isinstance(loop, str)
            and source and loop):
        return None
    if how == "unseen":
        exits = fact.get("exits")
        listed = f" (its exits: {exits})" if isinstance(exits, str) and exits else ""
        return source, f"when the loop at {loop} ended{listed}"
    if how.endswith("loop's end"):
        ran = "its condition was false" if how.startswith("while") else "its iterator ran out"
        return source, f"at the end of the loop at {loop} ({ran})"
    return source, f"at the {how} in {source} (the loop at {loop})"
