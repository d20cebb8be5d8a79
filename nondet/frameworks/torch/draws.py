"""Draws from torch's default generator made before the script seeds it.

nondet seeds torch alike in both runs before the script starts, so a script that builds its
model (or shuffles, or drops out) before its first ``torch.manual_seed`` (or never seeds)
repeats under nondet while its plain runs differ: torch 2.x starts its default generator
from fresh entropy in every process. The verdict alone would hide that (trl's SFT example
builds the model before ``Trainer`` calls ``set_seed``). This module names the line of the
first such draw as the fact ``torch.unseeded_draw``::

    {"site": "model.py:12", "op": "uniform_", "from": "train.py:30"}

(``from``: the outermost line of the user's files that led there, when it is another.)

``seed_diff.unseeded_script_notes`` turns it into a note (the two runs did repeat, so it is
no finding: Note [A draw before the first seeding is a note] there).

How: from the moment torch is imported until the script first seeds torch, training starts,
or the first draw, a ``TorchFunctionMode`` watches the calls whose name says they may draw
(``uniform_``, ``randn``, ``dropout``, ...); after one, the default generator's state is
compared with the state nondet's own seeding left. A seeding call (``torch.manual_seed``,
``torch.set_rng_state``, ``torch.seed``, made by the user or by a library that seeds for
them: HF ``set_seed``, Lightning ``seed_everything``, Keras ``set_random_seed``) ends the
watch silently, as does an ``initial_seed()`` other than nondet's (a seeding path not
wrapped, such as ``torch.default_generator.manual_seed``).

Limitations: the CPU default generator only (a draw on a CUDA device moves the CUDA one);
the calling thread only (the mode stack is thread-local); draws made while a module is
being imported are not the script's (the baseline moves on); the watch ends when training
starts, so a script that draws for the first time inside its training loop without ever
seeding is not named; a ``torch.default_generator.manual_seed(s)`` with ``s`` equal to
nondet's seed is not seen (the state is the same as nondet's).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nondet import session as session_module
from nondet.frameworks.base import Session
from nondet.frameworks.torch.tensors import to_numpy

FACT = "torch.unseeded_draw"
#: Parts of the names of calls that may draw from a generator (a cheap filter: the state
#: comparison decides).
_RANDOM_NAMES = ("rand", "normal", "uniform", "bernoulli", "dropout", "multinomial",
                 "poisson", "exponential", "geometric", "cauchy", "random_", "gamma",
                 "dirichlet", "binomial", "rrelu", "orthogonal", "sparse_")
#: The module functions that seed (or reseed) torch's default generator.
_SEEDING = ((torch, "manual_seed"), (torch.random, "manual_seed"), (torch, "seed"),
            (torch.random, "seed"), (torch, "set_rng_state"), (torch.random, "set_rng_state"))


@functools.lru_cache(maxsize=4096)
def _may_draw(name: str) -> bool:
    return any(part in name for part in _RANDOM_NAMES)


def _state(paused: Callable[[], AbstractContextManager[None]]) -> bytes:
    """The default generator's state, read unrecorded (``get_state`` makes a tensor: read
    inside the capture, it was an entry of the script's init step)."""
    with paused():
        return bytes(to_numpy(torch.default_generator.get_state()))


class _Watch(TorchFunctionMode):
    """Calls ``after`` after each call that may draw; passes every call through unchanged."""

    def __init__(self, after: Callable[[str], None]) -> None:
        super().__init__()
        self.after = after
        self.on = True

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.on:
            name = getattr(func, "__name__", "")
            if isinstance(name, str) and _may_draw(name):
                self.after(name)
        return out


class DrawWatch:
    """The run's watch for the first unseeded draw (one per session)."""

    def __init__(self, session: Session, seed: int,
                 paused: Callable[[], AbstractContextManager[None]]) -> None:
        self._session = session
        self._seed = seed
        self._paused = paused
        self._baseline = _state(paused)
        self._mode: _Watch | None = _Watch(self._after)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch
        # the init row's end (training starts) ends the watch; later step ends retry a pop
        listeners = getattr(session, "step_listeners", None)  # the child's Session has them
        if isinstance(listeners, list):
            listeners.append(lambda _step: self.stop())
        # A mode cannot leave the stack from inside its own handler (where a draw is found):
        # it goes at the next module call (before torch.compile would trace one) at the latest.
        from torch.nn.modules import module as nn_module

        self._hook: Any = nn_module.register_module_forward_pre_hook(self._module_call)

    def _module_call(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # traced by Dynamo: a removal there breaks the user's graph
        self._pop()
        self._unhook()

    def _unhook(self) -> None:
        if self._mode is None and self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def watching(self) -> bool:
        return self._mode is not None and self._mode.on

    def stop(self) -> None:
        """No more watching (seeded, training started, or found)."""
        if self._mode is not None:
            self._mode.on = False
        self._pop()

    def _pop(self) -> None:
        """Take the mode off the stack when it is on top (else: again at the next step end;
        a mode the script pushed above ours must be left in place)."""
        mode = self._mode
        if mode is None or mode.on:
            return
        try:
            depth = torch._C._len_torch_function_stack()
            if depth and torch._C._get_function_stack_at(depth - 1) is mode:
                mode.__exit__(None, None, None)
                self._mode = None
                # the module hook goes too, before torch.compile could trace it: its removal
                # in traced code would break the graph, and a later one make Dynamo recompile
                self._unhook()
        except Exception:
            pass  # left inactive: it passes calls through

    def _after(self, name: str) -> None:
        """A call that may have drawn has returned. Never raises into the script."""
        try:
            if session_module.current() is not self._session or self._seed_changed():
                self.stop()  # a forked child; or the script seeded by a path not wrapped
                return
            state = _state(self._paused)
            if state == self._baseline:
                return
            if _importing():
                self._baseline = state  # a library drawing at its import: not the script
                return
            where = self._session.sources.here(3)
            if where < 0:
                self._baseline = state  # no frame of the user's: nothing to name
                return
            fact = {"site": self._session.string(where), "op": name}
            outer = self._outermost_user_line()
            if outer >= 0 and outer != where:
                fact["from"] = self._session.string(outer)  # the model's line in the script
            self._session.send_facts({FACT: fact})
            self.stop()
        except Exception:
            self.stop()

    def _outermost_user_line(self) -> int:
        """String id of the outermost frame in the user's files (the script's own line that
        led to the draw, ``model = Net()``), or -1."""
        sources = self._session.sources
        frame: FrameType | None = sys._getframe(2)
        outer: FrameType | None = None
        while frame is not None:
            if sources.user_file(frame.f_code.co_filename):
                outer = frame
            frame = frame.f_back
        return -1 if outer is None else sources.intern_location(outer.f_code.co_filename,
                                                                outer.f_lineno)

    def _seed_changed(self) -> bool:
        return int(torch.initial_seed()) != self._seed

    def seeded(self) -> None:
        """A seeding call: the draws from here on follow the script's seed."""
        self.stop()


def install(session: Session, seed: int,
            paused: Callable[[], AbstractContextManager[None]]) -> DrawWatch | None:
    """Start watching (right after nondet's own seeding); wraps torch's seeding calls so
    that they end the watch; ``paused`` keeps nondet's own reads out of the capture. None
    when the watch cannot start (never raises)."""
    try:
        watch = DrawWatch(session, seed % 2**64, paused)
    except Exception:
        return None
    for owner, name in _SEEDING:
        original = getattr(owner, name, None)
        if original is not None:
            setattr(owner, name, _ending(watch, original))
    return watch


def _ending(watch: DrawWatch, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def seeding(*args: Any, **kwargs: Any) -> Any:
        watch.seeded()
        return function(*args, **kwargs)

    return seeding


def _importing() -> bool:
    """A module is being imported somewhere up the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
