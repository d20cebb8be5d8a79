"""What the TensorFlow backend costs a step in copies to the host (each one waits for a GPU),
measured on this CPU by counting them, and where it keeps its op-window flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from tests.frameworks.test_tf_capture import capture

#: A traced training step, run 6 times; steps 2 and 4 have op-level capture. Everything runs
#: under the script's own device scope (a second logical CPU stands in for a GPU). Every
#: ``.numpy()`` of an eager tensor or a variable is counted, nondet's and TF's alike.
SCRIPT = """
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops

counted = [0]
def counting(original):
    def numpy(self):
        counted[0] += 1
        return original(self)
    return numpy
ops._EagerTensorBase.numpy = counting(ops._EagerTensorBase.numpy)
resource_variable_ops.BaseResourceVariable.numpy = counting(
    resource_variable_ops.BaseResourceVariable.numpy)

with tf.device("/CPU:1"):
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    model.build((None, 4))
    opt = tf.keras.optimizers.Adam(0.01)
    x, y = tf.random.normal([16, 4]), tf.random.normal([16, 1])

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    per_step = []
    for _ in range(6):
        before = counted[0]
        train_step(x, y)
        per_step.append(counted[0] - before)

from nondet import session
backend = next(b for b in session.current().backends if b.name == "tensorflow")
with open(__file__ + ".json", "w") as f:
    json.dump({"per_step": per_step, "variables": len(model.variables + opt.variables),
               "flag": backend.recorder.vars.window_flag.device}, f)
"""


def test_a_traced_step_copies_to_the_host_twice_and_the_flag_stays_on_the_host(
    tmp_path: Path,
) -> None:
    c = capture(tmp_path, "import json\n" + SCRIPT, op_steps=[2, 4])
    assert c.n_steps == 6 and c.status == "complete"
    out = json.loads((tmp_path / "train.py.json").read_text())
    # The flag every guarded op reads: on the host, not on the script's device.
    assert out["flag"].endswith("/device:CPU:0"), out["flag"]
    # One read of what the call wrote (slots, update count, loss) and one of the step's
    # variable fingerprints, with or without op capture, however many variables there are;
    # a step that opens an op window (2 and 4: step 3 had none) reads once more, the
    # contents its first reads take (tensorflow/first_reads.py, Note [First reads]).
    assert out["variables"] > 6
    assert out["per_step"][1:] == [2, 3, 2, 3, 2], out["per_step"]
    # The fingerprints are still taken: every step has parameters and a loss; the captured
    # steps have op records.
    assert all(c.steps["params_fp"]) and all(c.steps["loss_fp"][1:])
    assert len(c.ops(2)) > 20 and len(c.ops(4)) > 20
