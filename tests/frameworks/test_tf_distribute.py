"""``tf.distribute.MirroredStrategy`` on two logical CPU devices: each replica traces the
train step, and so each calls ``optimizer.apply`` once per step (Keras 3 merges the
update across replicas); the step count must be the batches trained, not batches x
replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from tests.frameworks.test_tf_capture import run_script

MIRRORED = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np
keras.utils.set_random_seed(0)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x = np.random.default_rng(0).random((192, 8), dtype=np.float32)
y = np.random.default_rng(1).integers(0, 3, 192)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=64, epochs=2, verbose=0)
"""


def test_mirrored_strategy_counts_one_step_per_batch(tmp_path: Path) -> None:
    capture, _ = run_script(tmp_path, MIRRORED, header="")
    assert capture.n_steps == 6  # 192 / 64 batches x 2 epochs, whatever the replicas
    notes = [str(v) for k, v in capture.facts.items() if k.startswith("capture_note.")]
    assert not any("steps_per_execution" in n for n in notes), notes


def test_one_device_strategy_keeps_op_level_recording(tmp_path: Path) -> None:
    # h-realtf2: under OneDeviceStrategy no op of the step was recorded one by one (and the
    # note said "inside the replicas"): one device has neither replica threads nor
    # cross-device reads, so the guards work as without a strategy
    from nondet.records import Kind
    from tests.frameworks.test_tf_capture import records

    script = MIRRORED.replace(
        'cpu = tf.config.list_physical_devices("CPU")[0]\n', "").replace(
        "tf.config.set_logical_device_configuration(cpu, "
        "[tf.config.LogicalDeviceConfiguration()] * 2)\n", "").replace(
        'tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])',
        'tf.distribute.OneDeviceStrategy("/cpu:0")')
    assert "OneDeviceStrategy" in script and "logical" not in script
    capture, _ = run_script(tmp_path, script, op_steps=[-1, 0, 1], header="")
    assert capture.n_steps == 6
    ops = {str(r["name"]) for r in records(capture, 1) if r["kind"] == Kind.OP}
    assert "MatMul" in ops, ops
    notes = [str(v) for k, v in capture.facts.items() if k.startswith("capture_note.")]
    assert not any("tf.distribute" in n for n in notes), notes
