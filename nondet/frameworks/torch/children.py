"""Training in child processes (Hogwild, ``mp.spawn``): each child recorded as a run of its own.

A script that trains in processes it starts itself (``torch.multiprocessing`` or
``multiprocessing`` ``Process(target=train, args=(model, ...))``, fork or spawn) may run no
step in the recorded process. Each such child is recorded step by step: ``start`` swaps the
child's target for a ``ChildMain`` for the time of the start (a spawned child's Process is
pickled then; the user's object is given its target back at once), and in the child
``ChildMain`` opens a Session of its own that writes its frames to a file beside the run's
capture (``channel.child_frames_path``), installs a torch backend for it, runs the user's
target and ends the session. The parent stores and compares those files
(``nondet/child_captures.py``).

K is the child's creation order among the processes this run started (not its pid), so two
runs line up whatever the scheduling. Data workers are left out: DataLoader workers and
``multiprocessing.Pool`` workers make data, never train, and their start stays as cheap as
it is. So are ``ProcessPoolExecutor`` workers: pool workers take tasks as they come free,
and cannot be paired between the runs (``_DATA_WORKERS``); the fact ``POOL_FACT`` says a
pool was started, for the message when no step was observed elsewhere. A Process subclass
that overrides ``run()`` has no target to wrap and is not recorded step by step.

Beside that, the tensors handed to a child are fingerprinted afresh when the parent joins
it and sent as the fact ``child#K.params_fp``: the state it leaves behind, compared even
when its steps are not (``end_state.py``).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.process as mp_process
import traceback
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from nondet import frameworks
from nondet.channel import CHILD_ENTRY_PREFIX, CHILD_PARAMS_FACT, POOL_FACT
from nondet.frameworks.base import Session, StopRun
from nondet.frameworks.fp import group_fp
from nondet.frameworks.torch.cache import FingerprintCache
from nondet.frameworks.torch.shared import in_shared_memory
from nondet.frameworks.torch.state import holds_values
from nondet.records import INIT_STEP


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
            # a lazy module's parameters before its first call (any read raises) and meta
            # tensors hold no values yet: not state the child can change (state.py)
            found.extend(t for t in value.parameters() if holds_values(t))
            found.extend(t for t in value.buffers() if holds_values(t))
        elif isinstance(value, torch.Tensor):
            if holds_values(value):
                found.append(value)
        elif depth > 0 and isinstance(value, (tuple, list)):
            found.extend(_tensors_in(value, depth - 1))
        elif depth > 0 and isinstance(value, dict):
            found.extend(_tensors_in(value.values(), depth - 1))
    return found


_FORKED = "forked"  # a key of ChildMain's config that is not ChildConfig's
#: A child's first steps recorded op by op (beside the run's window).
CHILD_OP_STEPS = 32
#: Modules whose process targets are not recorded: DataLoader workers and ``multiprocessing``'s
#: own (Pool workers make data), and pool workers (``Pool``, ``ProcessPoolExecutor``), which
#: take tasks as they come free: the worker that ran a task in run a may run another in run
#: b, so two runs' workers cannot be paired by creation order (a sweep of deterministic
#: tasks, each seeding itself, read "a different seed" in 3 of 4 invocations).
_DATA_WORKERS = ("torch.utils.data", "multiprocessing", "concurrent.futures")
_POOL_WORKERS = ("multiprocessing.pool", "concurrent.futures")


#: Name of the entry a joined child's tensors make at their next read in the parent
#: (``end_state.child_entry`` reads it back).
CHILD_ENTRY = CHILD_ENTRY_PREFIX + "{}"


def _child_config(backend: ChildrenHost, index: int) -> dict[str, Any] | None:
    """The ChildConfig (as a dict: it is pickled into a spawned child) of the run's child
    ``index``, or None when this run has nowhere to put a child's frames."""
    config = backend.session.config
    children_dir = getattr(config, "children_dir", None)
    if not children_dir or config.dump is not None:
        return None  # no file to write to; or a run that measures one of this process's ops
    # No re-run can narrow a child down: ops are recorded at its first steps, where a race
    # between workers shows first, and in the run's window (every step with --ops all).
    op_steps = None if config.op_steps is None else sorted(
        {*config.op_steps, *range(INIT_STEP, CHILD_OP_STEPS)})
    return {"label": f"{config.label}.child{index}", "seed": config.seed,
            "channel_fd": -1, "control_fd": -1, "script": config.script,
            "module": config.module, "args": list(config.args),
            "op_steps": op_steps, "children_dir": children_dir}


def install(backend: ChildrenHost) -> None:
    """Wrap ``BaseProcess.start`` and ``join`` (every start method and context uses them)."""
    started = [0]  # children recorded by this run, in creation order
    pools = [False]  # a pool worker was started (POOL_FACT sent)
    # child -> (creation order, weak refs to its tensors); kept beside the Process, never on
    # it: a spawned child's Process object is pickled, and must stay as the user made it
    marks: weakref.WeakKeyDictionary[mp_process.BaseProcess,
                                     tuple[int, list[weakref.ref[torch.Tensor]]]] = \
        weakref.WeakKeyDictionary()
    original_start: Callable[..., None] = mp_process.BaseProcess.start
    original_join: Callable[..., None] = mp_process.BaseProcess.join

    @functools.wraps(original_start)
    def start(proc: mp_process.BaseProcess) -> None:
        target = getattr(proc, "_target", None)
        wrapped = False
        module = (getattr(target, "__module__", None) or "") if target is not None else ""
        if module.startswith(_POOL_WORKERS) and not backend.disabled and not pools[0]:
            pools[0] = True
            with backend.guarded():  # said once: why training there is not compared
                backend.session.send_facts({POOL_FACT: True})
        if not backend.disabled and target is not None and not module.startswith(_DATA_WORKERS):
            with backend.guarded():
                index = started[0]
                started[0] += 1
                args = getattr(proc, "_args", ())
                kwargs = getattr(proc, "_kwargs", {})
                tensors = _tensors_in([*args, *kwargs.values()])
                if tensors:
                    marks[proc] = (index, [weakref.ref(t) for t in tensors])
                if any(in_shared_memory(t) for t in tensors):
                    # While the child runs it may write them unseen by this process's
                    # version counters: every read here is an entry, hashed afresh.
                    backend.recorder.shared_is_volatile = True
                config = _child_config(backend, index)
                if config is not None:
                    method = getattr(proc, "_start_method", None) \
                        or multiprocessing.get_start_method(allow_none=True) \
                        or multiprocessing.get_all_start_methods()[0]  # the default
                    config[_FORKED] = method == "fork"
                    proc._target = ChildMain(target, config)  # type: ignore[attr-defined]
                    wrapped = True
        try:
            original_start(proc)
        finally:
            if wrapped:  # the child has its copy (forked, or pickled): the user's is restored
                proc._target = target  # type: ignore[attr-defined]

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
            for t in tensors:  # the next read here is an entry, named after the child
                backend.recorder.written_elsewhere(t, CHILD_ENTRY.format(index))
            digest = group_fp([f.value or 0 for f in fps])
            backend.session.send_facts({CHILD_PARAMS_FACT.format(index): f"{digest:016x}"})

    mp_process.BaseProcess.start = start  # type: ignore[method-assign,assignment]
    mp_process.BaseProcess.join = join  # type: ignore[method-assign,assignment]


class ChildMain:
    """The target of a recorded child process: the user's target, run under a Session of
    its own that writes to ``channel.child_frames_path`` (see the module docstring).

    Picklable by reference (spawn): it holds only the user's target and a dict. nondet's
    own failure to set up recording never stops the child: the target then runs as is."""

    def __init__(self, target: Callable[..., Any], config: dict[str, Any]) -> None:
        self.target = target
        self.config = config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from nondet import channel

        session = _open_session(self.config)
        if session is None:
            return self.target(*args, **kwargs)
        status, code, error = channel.COMPLETE, 0, ""
        try:
            return self.target(*args, **kwargs)
        except StopRun:
            status = channel.STOPPED
            return None
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            status = channel.COMPLETE if code == 0 else channel.FAILED
            raise
        except KeyboardInterrupt:
            status, code = channel.INTERRUPTED, 130
            raise
        except BaseException:
            error = traceback.format_exc()
            status, code = channel.FAILED, 1
            raise
        finally:
            _close_session(session, status, code, error)


def _open_session(config: dict[str, Any]) -> Any:
    """This child's Session with a torch backend installed, or None if that failed (told
    to the parent in the frames file when it got that far)."""
    import os

    from nondet import channel
    from nondet import session as session_module

    session = None
    try:
        config = dict(config)
        forked = config.pop(_FORKED, True)
        child = session_module.ChildConfig(**config)
        assert child.children_dir is not None
        child.channel_fd = os.open(channel.child_frames_path(child.children_dir, child.label),
                                   os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        session = session_module.Session(child)
        session_module._CURRENT = session
        from nondet.frameworks import fp as host_fp
        from nondet.frameworks.torch.backend import TorchBackend

        # The backend seeds torch for the run; a child keeps the generator state it was
        # started with (inherited by a fork, torch's default in a spawned interpreter).
        rng = torch.random.get_rng_state()
        host_fp.HOST_RNGS["python"] = False  # reseeded from entropy at every fork and spawn
        host_fp.HOST_RNGS["numpy"] = forked  # a spawned interpreter seeds it from entropy too
        backend = TorchBackend(session)
        torch.random.set_rng_state(rng)
        backend.recorder.shared_is_volatile = True  # other workers write shared weights
        frameworks.adopt(session, backend)
        # Its own forks (DataLoader workers) must not record into this child's file; a
        # spawned interpreter never ran boot, which registers the same for the run.
        os.register_at_fork(after_in_child=_forget_after_fork)
        return session
    except Exception:
        if session is not None:
            session.send_meta({"hook_error": traceback.format_exc()})
            session.writer.flush()
        session_module._CURRENT = None
        return None


def _forget_after_fork() -> None:
    from nondet import session as session_module

    session_module._CURRENT = None
    frameworks.disable_after_fork()


def _close_session(session: Any, status: str, code: int, error: str) -> None:
    """End the child's session: each backend's end state, then END. Never raises."""
    from nondet import session as session_module

    for backend in session.backends:
        try:
            status = backend.finish(status)
        except Exception:
            session.send_meta({"hook_error": traceback.format_exc()})
    try:
        session.finish(status, code, error)
    except Exception:
        pass  # the file is gone: the parent sees a child without END (crashed)
    session_module._CURRENT = None
