"""An output the graph declares empty is hashed empty (frameworks/tensorflow/traced.py,
``_as_declared``). oneDNN's kernels (TensorFlow's default on x86 CPUs) return
``FusedBatchNormGradV2/V3``'s unused reserve spaces, shaped (0,) in the graph, with one
value: the guard planned for an empty tensor refused to reshape it, and any tf_keras or
Sonnet BatchNorm step recorded op by op (a narrowing pair, ``--ops all``) ended "the script
failed" (``Input to reshape is a tensor with 1 values``). Without oneDNN the kernel makes
them empty and this test passes either way."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from tests.frameworks.test_tf_capture import records, run_script

BODY = """
scale = tf.Variable(tf.ones([3]))
offset = tf.Variable(tf.zeros([3]))
opt = tf.keras.optimizers.SGD(0.1)

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(x, scale, offset, is_training=True)
        loss = tf.reduce_mean(y ** 2)
    opt.apply(tape.gradient(loss, [scale, offset]), [scale, offset])

x = tf.random.normal([4, 6, 6, 3])
for _ in range(2):
    step(x)
"""


def test_fused_batch_norm_gradient_is_recorded_op_by_op(tmp_path: Path) -> None:
    c, _ = run_script(tmp_path, BODY, op_steps=[0, 1])  # failed: status "failed"
    assert c.n_steps == 2
    grads = [r for r in records(c, 1) if str(r["name"]).startswith("FusedBatchNormGrad")]
    assert grads  # the op itself is recorded (its guard runs)
