"""Training that updates its variables by hand, with no Keras optimizer (TensorFlow's "basic
training loops" guide, Sonnet 2 optimizers): each gradient of trainable variables and the
assignments after it is a step (frameworks/tensorflow/backend.py, Note [Updates by hand]).
Before, such a script had no step at all ("no training step was observed", exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from nondet.records import INIT_STEP, Group, Kind
from tests.frameworks.test_tf_capture import line_of, records, run_script

BODY = """
import numpy as np
w = tf.Variable(tf.random.normal([4, 1]))
b = tf.Variable(0.0)
x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
ds = tf.data.Dataset.from_tensor_slices(x).batch(16)

for bx in ds:  # EAGER BATCH
    bx = bx + 0.0  # NUDGE
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((bx @ w + b) ** 2)
    dw, db = tape.gradient(loss, [w, b])
    w.assign_sub(0.1 * dw)
    b.assign_sub(0.1 * db)

image = tf.constant(x[:2])
with tf.GradientTape() as tape:  # a gradient of an input, not of a variable: no update
    tape.watch(image)
    saliency = tape.gradient(tf.reduce_sum(image @ w), image)

@tf.function
def step(bx):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((bx @ w + b) ** 2)
    dw, db = tape.gradient(loss, [w, b])
    w.assign_sub(0.1 * dw)
    b.assign_sub(0.1 * db)
    return loss

for bx in ds.take(3):
    step(bx)

with tf.GradientTape() as tape:  # one more eager update, still open when...
    loss = tf.reduce_mean((x @ w + b) ** 2)
w.assign_sub(0.1 * tape.gradient(loss, w))
opt = tf.keras.optimizers.SGD(0.1)  # ...a Keras optimizer takes over the steps
for _ in range(2):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((x @ w + b) ** 2)
    opt.apply(tape.gradient(loss, [w, b]), [w, b])
"""


def test_updates_by_hand_are_steps(tmp_path: Path) -> None:
    c, _ = run_script(tmp_path, BODY, op_steps=[INIT_STEP, 0])
    # four eager updates, three traced, one eager (not merged into the first of the Keras
    # optimizer's two); the saliency is none
    assert c.n_steps == 4 + 3 + 1 + 2
    rows = [c.step_row(s) for s in range(INIT_STEP, c.n_steps)]
    params = [int(row["params_fp"]) for row in rows if row is not None]
    # every step's snapshot is taken after its assignments, so each differs from the last
    assert len(params) == 1 + c.n_steps and len(set(params)) == len(params)
    # training starts at the first tape, and the batch drawn just before it is step 0's
    assert not [r for r in c.tensor_rows(INIT_STEP) if r["group"] == Group.DATA]
    assert [r for r in c.tensor_rows(0) if r["group"] == Group.DATA]
    batch = line_of(tmp_path, "# EAGER BATCH")
    nudge = line_of(tmp_path, "# NUDGE")
    init_lines = {r["line"] for r in records(c, INIT_STEP)}
    assert batch not in init_lines and nudge not in init_lines
    step0 = records(c, 0)
    assert any(r["kind"] == Kind.ENTRY and r["line"] == batch for r in step0)
    assert {r["phase"] for r in step0 if r["line"] == nudge} == {"forward"}


LIBRARY_OPTIMIZER = '''
import tensorflow as tf


class Momentum(tf.Module):
    """Slots made on the first apply, as Sonnet's optimizers make theirs."""

    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.slots = None

    def apply(self, grads, params):
        if self.slots is None:
            with tf.init_scope():
                self.slots = [tf.Variable(tf.zeros_like(p), trainable=False) for p in params]
        for g, p, s in zip(grads, params, self.slots):
            s.assign(0.9 * s + g)
            p.assign_sub(self.lr * s)
'''

SLOTS_BODY = """
import sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from optimizers.momentum import Momentum

w = tf.Variable(tf.random.normal([4, 1]))
opt = Momentum(0.1)

@tf.function
def step(bx):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((bx @ w) ** 2)
    opt.apply(tape.gradient(loss, [w]), [w])

for _ in range(2):
    step(tf.ones([8, 4]))
"""


def test_a_library_optimizers_slots_made_while_tracing_are_optimizer_state(
        tmp_path: Path) -> None:
    # AutoGraph converts the library's apply (not TensorFlow's or Keras' own code): the
    # Python stack at the slot's creation holds only its generated file
    package = tmp_path / "lib" / "optimizers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "momentum.py").write_text(LIBRARY_OPTIMIZER)
    c, _ = run_script(tmp_path, SLOTS_BODY, op_steps=[0])
    assert c.n_steps == 2
    # (data rows, such as the initial values of the slots step 0 made, are no state)
    groups = {Group(int(r["group"])) for r in c.tensor_rows(0)} - {Group.DATA}
    assert groups == {Group.PARAM, Group.OPTIM}


LOOP_BODY = """
w = tf.Variable(tf.ones([4, 1]))
x = tf.ones([8, 4])

@tf.function
def train_epoch(steps):
    for _ in tf.range(steps):  # the epoch inside one call
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ w) ** 2)
        w.assign_sub(0.01 * tape.gradient(loss, w))

for _ in range(2):
    train_epoch(tf.constant(3))
"""


def test_updates_in_a_loop_inside_one_call_are_steps_noted_as_such(tmp_path: Path) -> None:
    # the note said "such as a GAN's two optimizers" for an epoch looped in a tf.function
    c, _ = run_script(tmp_path, LOOP_BODY, op_steps=[INIT_STEP])
    assert c.n_steps == 2 * 3
    notes = {k for k in c.facts if k.startswith("capture_note.")}
    assert "capture_note.updates_in_loop" in notes
    assert "capture_note.updates_per_call" not in notes


MIRRORED_EAGER = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np
keras.utils.set_random_seed(0)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x = np.random.default_rng(0).random((96, 4), dtype=np.float32)
ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(32))
with strategy.scope():
    w = tf.Variable(tf.ones([4, 1]))
    opt = keras.optimizers.SGD(0.1) if BY_KERAS else None

def replica_step(bx):  # strategy.run without tf.function: each replica is a thread
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((bx @ w) ** 2)
    dw = tape.gradient(loss, w)
    if opt is not None:
        opt.apply([dw], [w])
    else:
        w.assign_sub(0.1 * tf.distribute.get_replica_context().all_reduce("sum", dw))

for epoch in range(2):
    for batch in ds:
        strategy.run(replica_step, args=(batch,))
"""


@pytest.mark.parametrize("by_keras", [False, True])
def test_mirrored_strategy_run_eagerly_counts_one_step_per_batch(
        tmp_path: Path, by_keras: bool) -> None:
    # by hand the replicas' threads each ended steps (refused: "trains in two threads at
    # once"); with a Keras optimizer each replica's apply was a step (6 batches, 12 steps)
    c, _ = run_script(tmp_path, MIRRORED_EAGER.replace("BY_KERAS", str(by_keras)), header="")
    assert c.n_steps == 3 * 2


DATA_STAGE = """
w = tf.Variable(tf.ones([4, 1]))

def adversarial(x):  # a gradient of the model's variables inside a tf.data stage
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x[None] @ w)
    return x + 0.01 * tf.reduce_sum(tape.gradient(loss, w))

ds = tf.data.Dataset.from_tensor_slices(tf.ones([16, 4])).map(adversarial).batch(4)

@tf.function
def step(bx):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((bx @ w) ** 2)
    w.assign_sub(0.01 * tape.gradient(loss, w))

for bx in ds:
    step(bx)
"""


def test_a_gradient_inside_a_tf_data_stage_is_no_update(tmp_path: Path) -> None:
    # tf.data runs the stage on its threads, as far ahead as prefetching goes: counted, the
    # updates would have fallen in whichever step the pipeline ran in
    c, _ = run_script(tmp_path, DATA_STAGE, op_steps=[INIT_STEP])
    assert c.n_steps == 4
