"""TensorFlow 1 graph mode (``Session.run``), which nondet does not record, is said in one
line (frameworks/tensorflow/graph_mode.py). Before, ``disable_eager_execution`` ended the
run as a nondet bug (exit 3: its state read failed on symbolic tensors), and a graph built
under ``tf.Graph().as_default()`` got only "no training step was observed"."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from nondet.analysis import compare_pair
from nondet.errors import NondetError
from nondet.launch import CapturedRun
from nondet.runspec import Plan, RunResult, Target
from nondet.store import open_capture
from tests.frameworks.test_tf_capture import line_of

TRAIN = """
x = tf.compat.v1.placeholder(tf.float32, [None, 4])
w = tf.compat.v1.get_variable("w", [4, 1])
loss = tf.reduce_mean(tf.square(x @ w - 1.0))
train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())  # FIRST RUN
    for _ in range(3):
        sess.run(train_op, feed_dict={x: np.ones((8, 4), np.float32)})
"""

HEADER = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
tf.compat.v1.set_random_seed(0)
"""


def _run(tmp_path: Path, body: str) -> RunResult:
    script = tmp_path / "train.py"
    script.write_text(HEADER + textwrap.dedent(body))
    run = CapturedRun(Target(str(script), None, ()), Plan("t", None), 0, tmp_path / "out")
    run.start()
    return run.wait()


def test_disabling_eager_execution_is_refused_in_one_line(tmp_path: Path) -> None:
    result = _run(tmp_path, "tf.compat.v1.disable_eager_execution()  # OFF\n" + TRAIN)
    assert not result.hook_error, result.hook_error  # never nondet's bug
    # the script's line, not nondet's or TensorFlow's
    assert f"disable_eager_execution at {tmp_path / 'train.py'}:{line_of(tmp_path, '# OFF')})" \
        in result.unsupported


def test_a_session_in_a_graph_of_its_own_is_named(tmp_path: Path) -> None:
    body = "with tf.Graph().as_default():\n" + textwrap.indent(TRAIN, "    ")
    result = _run(tmp_path, body)
    assert result.status == "complete", result.log_tail()
    assert not result.hook_error, result.hook_error
    c = open_capture(result.path)
    assert c.n_steps == 0
    with pytest.raises(NondetError, match=r"Session\.run") as raised:
        compare_pair(c, c)
    assert f"train.py:{line_of(tmp_path, '# FIRST RUN')}" in str(raised.value)
