"""TensorFlow's state hash does not depend on the order the variables were made in
(tensorflow/backend.py, Note [Variables in the order of their names])."""

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
