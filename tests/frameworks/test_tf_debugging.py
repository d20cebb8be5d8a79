"""TensorFlow's own debugging tools run under nondet as they do without it (TensorFlow round
12: every script turning them on failed under nondet only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from tests.conftest import run_cli

SCRIPT = """
import os, sys, tempfile
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
if sys.argv[1] == "check_numerics":
    tf.debugging.enable_check_numerics()
else:
    tf.debugging.experimental.enable_dump_debug_info(
        tempfile.mkdtemp(), tensor_debug_mode="CURT_HEALTH", circular_buffer_size=100)
tf.keras.utils.set_random_seed(0)
w = tf.Variable(tf.ones([4, 1]))
opt = tf.keras.optimizers.SGD(0.1)

def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
    opt.apply_gradients([(tape.gradient(loss, w), w)])
    return loss

if sys.argv[2] == "traced":
    step = tf.function(step)
for i in range(4):
    step(tf.ones([2, 4]) * 0.1 * i)
"""


@pytest.mark.parametrize("mode", ["eager", "traced"])
@pytest.mark.parametrize("tool", ["check_numerics", "dump_debug_info"])
def test_tensorflows_debugging_callbacks_run_under_nondet(tmp_path: Path, tool: str,
                                                          mode: str) -> None:
    """nondet's op callback returned None, which TensorFlow hands the next callback as the
    op's outputs ("TypeError: 'NoneType' object is not iterable", reported as the script's
    failure); and check_numerics put its NaN check on nondet's own hash words (exit 3)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script), tool, mode,
                     cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["steps"] for r in report["runs"]] == [4, 4]
