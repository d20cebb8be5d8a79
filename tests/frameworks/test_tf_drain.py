"""What the TensorFlow recorder reads after every call of a traced function (the update
count, the carried loss, the op slots) comes back in one read-back, from one function call
(issue 15: done as a dozen eager ops it cost as much CPU per step as the state hash), and
leaves the slots and the carried loss zeroed for the next call."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.framework import op_callbacks  # noqa: E402

from nondet.frameworks.tensorflow.graph import RecorderVariables  # noqa: E402


def _eager_ops_in(action: Any) -> tuple[Any, list[str]]:
    """``action()`` and the eager ops it ran (each is a dispatch through the op callbacks,
    which nondet's recorder installs: the slow path)."""
    seen: list[str] = []

    def callback(op_type: Any, inputs: Any, attrs: Any, outputs: Any,
                 op_name: Any = None, graph: Any = None) -> None:
        if graph is None:
            seen.append(op_type.decode() if isinstance(op_type, bytes) else str(op_type))

    op_callbacks.add_op_callback(callback)
    try:
        result = action()
    finally:
        op_callbacks.remove_op_callback(callback)
    return result, seen


@pytest.mark.parametrize("slots", [0, 5])
def test_drain_reads_and_zeroes_in_one_call(slots: int) -> None:
    recorder = RecorderVariables(False)
    recorder.drain(slots)  # the first call traces the drain
    recorder.updates.assign(3)
    recorder.loss_hash.assign(42)
    recorder.loss_value.assign(1.5)
    recorder.buffer[:7].assign(np.arange(11, 18, dtype=np.int64))
    (updates, loss_hash, loss_value, values), ops = _eager_ops_in(
        lambda: recorder.drain(slots))
    assert (updates, loss_hash, loss_value) == (3, 42, 1.5)
    assert values.tolist() == list(range(11, 11 + slots))
    assert len(ops) == 1, ops  # one function call, not a read, a concat, assignments...
    assert int(recorder.loss_hash.numpy()) == 0
    assert recorder.buffer[:7].numpy().tolist() == [0] * slots + list(range(11 + slots, 18))
    assert int(recorder.updates.numpy()) == 3  # a running count: never zeroed
    recorder.loss_hash.assign(0)
    assert recorder.drain(slots)[1] == 0


def test_the_window_flag_is_assigned_only_when_it_changes() -> None:
    # set_window runs at every step end: an eager assignment each time was a dispatch
    # through the op callbacks (~0.4 ms of CPU per step with --ops all)
    from types import SimpleNamespace

    from nondet.frameworks.tensorflow.ops import TFOpRecorder

    session = SimpleNamespace(config=SimpleNamespace(op_steps=None), sources=None)
    backend = SimpleNamespace(session=session, disabled=True, own_variables=contextlib.nullcontext)
    recorder = TFOpRecorder(backend)  # type: ignore[arg-type]
    try:
        recorder.active = True
        recorder.vars  # noqa: B018  # made with the window open
        _, same = _eager_ops_in(lambda: [recorder.set_window(True) for _ in range(3)])
        _, closed = _eager_ops_in(lambda: recorder.set_window(False))
        _, reopened = _eager_ops_in(lambda: recorder.set_window(True))
    finally:
        op_callbacks.remove_op_callback(recorder._callback)
    assert same == [] and len(closed) == 1 and len(reopened) == 1, (same, closed, reopened)
    assert bool(recorder.vars.window_flag.numpy()) is True
