"""A ``tf.function`` called from a thread other than the one nondet records (a helper inside
a ``tf.py_function`` of a tf.data ``map``; a background thread) leaves the step's calls and
data rows alone (hooks.py, Note [Calls from other threads]). Before, such a call was pushed
on the recorder's shared call stack, so the main thread's traced call lost its entries (or
the other thread's call trimmed them away) at points set by thread timing: a deterministic
script's data rows differed between two runs, a false alarm. Each script runs twice as the
first pair runs it; every step has exactly one row of its graph input, and the two runs'
data rows are the same. Likewise a batch drawn in Python by a loader thread is no data of
the step the main thread happens to be in."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

pytest.importorskip("tensorflow")

from nondet.launch import CapturedRun, Plan, Target
from nondet.records import INIT_STEP, Group
from nondet.store import Capture, open_capture
from tests.frameworks.test_tf_capture import HEADER

MODEL = """
import threading
import numpy as np
w = tf.Variable(tf.random.normal([16, 1]))
opt = tf.keras.optimizers.SGD(0.01)
X = np.random.default_rng(0).random((1024, 16), dtype=np.float32)

@tf.function
def train(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((x @ w) ** 2)
    opt.apply_gradients([(tape.gradient(loss, w), w)])
    return loss
"""

PY_FUNCTION = """
@tf.function
def augment(x):  # a preprocessing helper written as a tf.function
    return tf.tanh(x * 2.0 + 1.0)

ds = (tf.data.Dataset.from_tensor_slices(X).batch(16)
      .map(lambda x: tf.py_function(augment, [x], tf.float32), num_parallel_calls=4)
      .prefetch(8).repeat())
for _, xb in zip(range(STEPS), ds):
    train(xb.numpy())  # the batch handed over as NumPy: a graph input made from host data
"""

BACKGROUND = """
big = tf.random.normal([200, 200])

@tf.function
def background_work(m):  # a monitoring thread's function
    for _ in tf.range(3):
        m = tf.tanh(m @ m * 1e-3)
    return tf.reduce_sum(m)

stop = threading.Event()
def worker():
    while not stop.is_set():
        background_work(big)
thread = threading.Thread(target=worker, daemon=True)
thread.start()
for _ in range(STEPS):
    train(X[:64])  # NumPy passed straight in: a graph input made from host data
stop.set()
thread.join()
"""

LOADER = """
import queue
ds = tf.data.Dataset.from_tensor_slices(X).batch(16).repeat()
batches = queue.Queue(maxsize=4)
def loader():  # a Python thread drawing from tf.data eagerly, feeding the training loop
    for i, xb in enumerate(ds):
        if i >= STEPS:
            break
        batches.put(xb.numpy())
threading.Thread(target=loader, daemon=True).start()
for _ in range(STEPS):
    train(batches.get())
"""

STEPS = 40


def _run(tmp_path: Path, name: str) -> Capture:
    run = CapturedRun(Target(str(tmp_path / "train.py"), None, ()),
                      Plan(name, [INIT_STEP, 0], ops_optional=True), 0, tmp_path / name)
    run.start()
    result = run.wait(timeout=600)
    assert result.status == "complete", result.log_tail()
    assert not result.hook_error, result.hook_error
    return open_capture(result.path)


def _data_rows(c: Capture) -> list[list[tuple[str, int]]]:
    """Per step, its data rows as (label, fingerprint)."""
    return [[(c.string(int(r["name"])), int(r["fp"])) for r in c.tensor_rows(step)
             if int(r["group"]) == Group.DATA] for step in range(c.n_steps)]


def _check(tmp_path: Path, body: str) -> None:
    (tmp_path / "train.py").write_text(HEADER + MODEL + dedent(body).replace("STEPS", str(STEPS)))
    runs = [_data_rows(_run(tmp_path, name)) for name in ("a", "b")]
    for rows in runs:
        assert len(rows) == STEPS
        inputs = [sum(label.startswith("external:graph input") for label, _ in step)
                  for step in rows]
        assert inputs == [1] * STEPS, inputs  # one graph input per step, never lost
    assert runs[0] == runs[1]


def test_a_tf_function_in_a_tf_data_py_function_leaves_the_steps_data_alone(
        tmp_path: Path) -> None:
    _check(tmp_path, PY_FUNCTION)


def test_a_tf_function_called_by_a_background_thread_leaves_the_steps_data_alone(
        tmp_path: Path) -> None:
    _check(tmp_path, BACKGROUND)


def test_a_loader_thread_drawing_from_tf_data_leaves_the_steps_data_alone(
        tmp_path: Path) -> None:
    # its batches were data rows of whichever step the main thread was in
    _check(tmp_path, LOADER)
