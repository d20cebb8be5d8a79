"""TensorFlow 1 graph mode, which nondet does not record, said in one line.

nondet records TensorFlow 2 code: eager ops, ``tf.function`` graphs, Keras. A script written
for TensorFlow 1 builds a graph and trains it with ``tf.compat.v1.Session.run``:

- after ``tf.compat.v1.disable_eager_execution()`` (or ``disable_v2_behavior()``) every op
  builds a graph, and nondet's own state reads (eager) fail: the run ended as a nondet bug
  (exit 3). The call now stops recording and tells the parent the run is unsupported, with
  the script's line (exit 2, one line);
- inside ``with tf.Graph().as_default():`` the script's variables are not seen, and the
  report said only "no training step was observed": the first ``Session.run`` is now a
  fact (``tf.session_run``, its line), which that message names.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Any, Protocol

import tensorflow as tf

from nondet import channel
from nondet.frameworks.base import Session

SESSION_RUN_FACT = "tf.session_run"


class GraphModeHost(Protocol):
    session: Session
    disabled: bool

    def guarded(self) -> AbstractContextManager[None]: ...

    def disable(self) -> None: ...


def unsupported_text(line: str) -> str:
    return ("the script turns off eager execution (tf.compat.v1.disable_eager_execution"
            f"{' at ' + line if line else ''}) to train in TensorFlow 1 graph mode "
            "(Session.run), which nondet does not record: it records TensorFlow 2 code "
            "(eager, tf.function, Keras)")


def install(backend: GraphModeHost) -> None:
    from tensorflow.python.client import session as session_lib
    from tensorflow.python.framework import ops

    original_disable = ops.disable_eager_execution

    @functools.wraps(original_disable)
    def disable_eager_execution(*args: Any, **kwargs: Any) -> Any:
        if not backend.disabled:
            with backend.guarded():
                sid = backend.session.sources.here(2)
                line = backend.session.string(sid) if sid >= 0 else ""
                backend.session.send_meta({channel.META_UNSUPPORTED: unsupported_text(line)})
            backend.disable()  # nothing it does from here on can be recorded
        return original_disable(*args, **kwargs)

    # v2_compat.disable_v2_behavior calls it through the module; tf.compat.v1 holds its own
    # reference, bound when the API modules were generated
    ops.disable_eager_execution = disable_eager_execution
    tf.compat.v1.disable_eager_execution = disable_eager_execution

    original_run = session_lib.BaseSession.run
    seen: list[bool] = []

    @functools.wraps(original_run)
    def run(session: Any, *args: Any, **kwargs: Any) -> Any:
        if not seen and not backend.disabled:
            seen.append(True)
            with backend.guarded():
                sid = backend.session.sources.here(2)
                backend.session.send_facts(
                    {SESSION_RUN_FACT: backend.session.string(sid) if sid >= 0 else "?"})
        return original_run(session, *args, **kwargs)

    session_lib.BaseSession.run = run
