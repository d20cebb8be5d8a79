"""Data entering a TensorFlow run at a traced call, in the step rows of a first pair
(frameworks/tensorflow/entries.py): named with its line ("placed") only when the op-level
records of a re-run would name it so as the step's first difference; otherwise without a
line, so that the pipeline still narrows. Each test runs one small captured script as the
first pair runs it (init and step 0 in an optional op window, declined at the trace)."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

pytest.importorskip("tensorflow")

from nondet.launch import CapturedRun, Plan, Target
from nondet.records import INIT_STEP, Group
from nondet.store import Capture, open_capture
from tests.frameworks.test_tf_capture import HEADER, line_of

MODEL = """
import numpy as np
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="tanh"),
                             tf.keras.layers.Dense(1)])
opt = tf.keras.optimizers.SGD(0.1)
arr = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
labels = np.zeros((16, 1), np.float32)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


@tf.function
def prep(x):
    return x * 2.0 + tf.random.uniform(tf.shape(x))  # a random op: may make a difference


@tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
def shape_only(x):
    return tf.zeros_like(x)  # a ZerosLike of x (its shape is not static): never its values
"""


def _first_pair_run(tmp_path: Path, body: str) -> Capture:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "train.py"
    script.write_text(HEADER + MODEL + dedent(body))
    run = CapturedRun(Target(str(script), None, ()),
                      Plan("a", [INIT_STEP, 0], ops_optional=True), 0, tmp_path / "out")
    run.start()
    result = run.wait(timeout=600)
    assert result.status == "complete", result.log_tail()
    assert not result.hook_error, result.hook_error
    return open_capture(result.path)


def _data(c: Capture, step: int) -> list[str]:
    """The step's data rows, each as "kind:what" or "kind:what @ line"."""
    labels = [c.string(int(r["name"])) for r in c.tensor_rows(step)
              if int(r["group"]) == Group.DATA]
    return [f"{name} @ {where.rpartition(':')[2]}" if where else name
            for name, _, where in (label.partition(" @ ") for label in labels)]


def test_graph_inputs_made_from_host_data_are_named_at_their_line_when_first(
        tmp_path: Path) -> None:
    body = """
    for step in range(6):
        if step == 0:
            train_step(tf.constant(arr), tf.constant(labels))  # STEP0
        elif step == 1:
            train_step(arr, labels)  # NumPy arrays passed straight
        elif step == 2:
            train_step(prep(tf.constant(arr)).numpy(), labels)  # after a call that may differ
        elif step == 3:
            train_step(tf.random.normal((16, 4)), labels)  # an eager op made x
        elif step == 4:
            shape_only(np.empty((1000, 4), np.float32))  # unread memory: no data
            train_step(tf.convert_to_tensor(arr), labels)
        else:
            train_step(tf.constant(arr) + 0, labels)  # computed from host data: not an entry
    """
    c = _first_pair_run(tmp_path, body)
    assert c.op_steps() == [INIT_STEP]  # step 0 declined: these rows are all it has
    step0 = line_of(tmp_path, "# STEP0")
    placed = f"external:graph input @ {step0}"
    # x is read first, by the model: nothing before it could differ. y is read by the loss,
    # after ops that could have made a difference: not placed (a difference there narrows).
    # Adam-free SGD still makes variables in the first trace: checked by value first.
    assert _data(c, 0)[-2:] == [placed, "external:graph input"]
    # A graph input's line is where the function was traced (as the op records name it).
    assert _data(c, 1) == [placed, "external:graph input"]
    # prep's own input is placed (where prep was traced); train_step's come after prep's
    # random op
    prep_line = line_of(tmp_path, "after a call that may differ")
    assert _data(c, 2) == [f"external:graph input @ {prep_line}", "external:graph input",
                           "external:graph input"]
    assert placed not in _data(c, 3) and _data(c, 3)[-1] == "external:graph input"
    # the empty array is no data row; a re-run records it, so nothing after it is placed
    assert _data(c, 4) == ["external:graph input", "external:graph input"]
    assert _data(c, 5)[-1] == "external:graph input" and placed not in _data(c, 5)


def test_batches_read_inside_keras_fit_are_named_at_the_fit_line(tmp_path: Path) -> None:
    body = """
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    model.fit(x, np.zeros((64, 1), np.float32), batch_size=16, epochs=1, verbose=0)  # FIT
    """
    c = _first_pair_run(tmp_path, body)
    fit = line_of(tmp_path, "# FIT")
    for step in range(c.n_steps - 1):  # every step of the epoch
        batches = [d for d in _data(c, step) if d.startswith("tf_data:IteratorGetNext")]
        assert batches == [f"tf_data:IteratorGetNext @ {fit}"], (step, _data(c, step))


def test_a_batch_read_eagerly_by_a_loop_is_named_as_the_op_records_name_it(
        tmp_path: Path) -> None:
    body = """
    ds = tf.data.Dataset.from_tensor_slices((arr, labels)).batch(4)
    for xb, yb in ds:  # LOOP
        train_step(xb, yb)
    """
    c = _first_pair_run(tmp_path, body)
    loop = line_of(tmp_path, "# LOOP")
    for step in range(4):
        # the iterator's eager IteratorGetNext is the entry a re-run records first; the
        # tensors it made are no graph inputs of train_step
        assert _data(c, step)[:2] == [f"tf_data:IteratorGetNext @ {loop}",
                                      "tf_data:iterator next"]
        assert not any(d.startswith("external:graph input") for d in _data(c, step))


def test_a_batch_read_in_a_nested_function_is_placed_only_if_its_callers_traced_nothing_first(
        tmp_path: Path) -> None:
    # A nested tf.function is traced inside its caller's trace: an op the caller traced
    # before calling it runs first, and a re-run records it before the batch (entries.py,
    # TraceOrder._unpreceded). Before, only the callee's own graph was looked at: the batch
    # of ``after_op`` was placed while the same code written flat was not.
    body = """
    import nondet
    it = iter(tf.data.Dataset.from_tensor_slices(arr).batch(4).repeat())
    w = tf.Variable(tf.ones([4, 1]))
    flat = tf.ones([2, 4])

    @tf.function
    def draw(it):
        return it.get_next()

    @tf.function
    def after_op(it, flat):
        noise = tf.reduce_sum(tf.matmul(flat, w))  # can make a difference, traced first
        return tf.reduce_sum(draw(it) @ w) + noise

    @tf.function
    def after_op_flat(it, flat):  # the same without the nesting
        noise = tf.reduce_sum(tf.matmul(flat, w))
        return tf.reduce_sum(it.get_next() @ w) + noise

    @tf.function
    def draw_first(it):  # (a function of its own: a nested one is traced once, then shared)
        return it.get_next()  # DRAW FIRST

    @tf.function
    def first(it, flat):  # the batch first: placed, nested or not
        x = draw_first(it)
        return tf.reduce_sum(x @ w) + tf.reduce_sum(tf.matmul(flat, w))

    for step in range(3):
        (after_op, after_op_flat, first)[step](it, flat)
        nondet.step()
    """
    c = _first_pair_run(tmp_path, body)
    batches = [[d for d in _data(c, step) if d.startswith("tf_data:IteratorGetNext")]
               for step in range(3)]
    assert batches == [["tf_data:IteratorGetNext"], ["tf_data:IteratorGetNext"],
                       [f"tf_data:IteratorGetNext @ {line_of(tmp_path, '# DRAW FIRST')}"]]
