"""Training in child processes (Hogwild): the parameters the run sees after a child joined.

A script that trains in processes it starts itself (``torch.multiprocessing`` or
``multiprocessing`` ``Process(target=train, args=(model, ...))``, fork or spawn) runs no
step in the recorded process: its children update the shared parameters. Their steps are
not recorded (the hooks live in the recorded process only); what is recorded is the state
they leave behind: when the parent joins a child that was given modules or tensors, their
parameters are fingerprinted afresh and sent as the fact ``child#K.params_fp``.

K is the child's creation order among the processes this run started (not its pid), so the
facts of two runs line up whatever the scheduling. Daemon processes (DataLoader workers) are
skipped: they never train, and their start must stay as cheap as it is.
"""

from __future__ import annotations

import functools
import multiprocessing.process as mp_process
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from nondet.channel import CHILD_PARAMS_FACT
from nondet.frameworks.base import Session, group_fp
from nondet.frameworks.torch.cache import FingerprintCache


class ChildrenHost(Protocol):
    """What this module asks of the torch backend (it never imports the backend)."""

    disabled: bool

    @property
    def session(self) -> Session: ...

    @property
    def recorder(self) -> FingerprintCache: ...

    def guarded(self) -> AbstractContextManager[None]: ...

    def paused_capture(self) -> AbstractContextManager[None]: ...


def _tensors_in(values: Iterable[Any], depth: int = 2) -> list[torch.Tensor]:
    """Parameters and buffers of the modules, and the tensors, passed to a child: its args
    and kwargs, and tuples, lists and dicts in them ``depth`` levels down
    (``torch.multiprocessing.spawn`` wraps the user's args in a tuple of its own)."""
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.nn.Module):
            found.extend(value.parameters())
            found.extend(value.buffers())
        elif isinstance(value, torch.Tensor):
            found.append(value)
        elif depth > 0 and isinstance(value, (tuple, list)):
            found.extend(_tensors_in(value, depth - 1))
        elif depth > 0 and isinstance(value, dict):
            found.extend(_tensors_in(value.values(), depth - 1))
    return found


def install(backend: ChildrenHost) -> None:
    """Wrap ``BaseProcess.start`` and ``join`` (every start method and context uses them)."""
    started = [0]  # children with tensors started by this run, in creation order
    # child -> (creation order, weak refs to its tensors); kept beside the Process, never on
    # it: a spawned child's Process object is pickled, and must stay as the user made it
    marks: weakref.WeakKeyDictionary[mp_process.BaseProcess,
                                     tuple[int, list[weakref.ref[torch.Tensor]]]] = \
        weakref.WeakKeyDictionary()
    original_start: Callable[..., None] = mp_process.BaseProcess.start
    original_join: Callable[..., None] = mp_process.BaseProcess.join

    @functools.wraps(original_start)
    def start(proc: mp_process.BaseProcess) -> None:
        if not backend.disabled and not proc.daemon:
            with backend.guarded():
                args = getattr(proc, "_args", ())
                kwargs = getattr(proc, "_kwargs", {})
                tensors = _tensors_in([*args, *kwargs.values()])
                if tensors:
                    marks[proc] = (started[0], [weakref.ref(t) for t in tensors])
                    started[0] += 1
        original_start(proc)

    @functools.wraps(original_join)
    def join(proc: mp_process.BaseProcess, timeout: float | None = None) -> None:
        original_join(proc, timeout)
        mark = marks.get(proc)
        if mark is None or backend.disabled or proc.exitcode is None:
            return  # not ours, or still running (a join with a timeout)
        with backend.guarded():
            del marks[proc]  # a second join must not send the fact again
            index, refs = mark
            tensors = [t for t in (ref() for ref in refs) if t is not None]
            with backend.paused_capture():
                # Afresh, never from the fingerprint cache: the child changed the shared
                # memory without bumping the version counters this process sees.
                fps = [backend.recorder.fingerprint(t) for t in tensors]
                backend.recorder.resolve()
            digest = group_fp([f.value or 0 for f in fps])
            backend.session.send_facts({CHILD_PARAMS_FACT.format(index): f"{digest:016x}"})

    mp_process.BaseProcess.start = start  # type: ignore[method-assign,assignment]
    mp_process.BaseProcess.join = join  # type: ignore[method-assign,assignment]
