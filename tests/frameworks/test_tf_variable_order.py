"""TensorFlow variables: the state hash does not depend on the order they were made in
(tensorflow/backend.py, Note [Variables in the order of their names]), and nondet's own
are made outside a library's variable creator scope (``TFBackend.own_variables``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

MADE_IN_ORDER = """
import numpy as np
names = ["head", "body"] if ORDER == "ab" else ["body", "head"]
made = {n: tf.Variable(np.full((3, 2) if n == "head" else (2,), 0.5, np.float32), name=n)
        for n in names}
extra = {n: tf.Variable(1.0, name=n + "_scale") for n in names}  # made at step 1
opt = tf.keras.optimizers.SGD(0.1)
variables = [made["head"], made["body"]]
for step in range(3):
    if step == 1:
        variables += [extra["head"], extra["body"]]
        opt = tf.keras.optimizers.SGD(0.1)  # built for the new set
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * v) for v in variables])
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
"""


def test_the_state_of_variables_made_in_another_order_is_the_same(tmp_path: Path) -> None:
    """TensorFlow round 11: a SavedModel loaded mid-training makes its variables in an
    order that varies between processes, with the same values; the state hash folded them
    in creation order and "RestoreV2 creates the difference" (exit 1, plain runs alike)."""
    from tests.frameworks.test_tf_capture import run_script

    steps = []
    for order in ("ab", "ba"):
        capture, _ = run_script(tmp_path / order, f'ORDER = "{order}"\n' + MADE_IN_ORDER)
        steps.append([(int(r["step"]), int(r["params_fp"]), int(r["data_fp"]))
                      for r in capture.steps])
    assert steps[0] == steps[1]
    assert len(steps[0]) >= 3


LOADED_FIRST = """
module = tf.saved_model.load(SAVED)  # the script's first TensorFlow call
w = tf.Variable(tf.ones((4, 1)))
opt = tf.keras.optimizers.SGD(0.1)
for step in range(3):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(module.scale(tf.ones((2, 4))) @ w)
    opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
"""


def test_a_savedmodel_loaded_as_the_scripts_first_call_is_recorded(tmp_path: Path) -> None:
    """TensorFlow round 11: nondet makes its own variables at the first op it sees; inside
    the SavedModel loader's variable creator scope they failed ("Cannot convert the
    argument `type_value`: None to a TensorFlow DType", exit 3) on the usual fine-tune of a
    frozen SavedModel base."""
    import tensorflow as tf

    class Scale(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.factor = tf.Variable(2.0)

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def scale(self, x: tf.Tensor) -> tf.Tensor:
            return x * self.factor

    saved = tmp_path / "saved"
    tf.saved_model.save(Scale(), str(saved))
    from tests.frameworks.test_tf_capture import run_script

    header = ("import os\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'\nimport tensorflow as tf\n"
              f"SAVED = {str(saved)!r}\n")
    capture, _ = run_script(tmp_path / "run", LOADED_FIRST, header=header)
    assert len([r for r in capture.steps if int(r["step"]) >= 0]) == 3
