"""Keras 2 (the ``tf_keras`` package): its training steps, its seeding call and its
``fit(workers=...)`` are seen (frameworks/tensorflow/hooks.py, data.py, pyhooks.py); before,
a tf_keras script ended "no training step was observed" (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")

from nondet.analysis import compare_pair
from nondet.seed_diff import UNSEEDED_TF_NOTE, seed_calls
from tests.frameworks.test_tf_capture import line_of, run_script
from tests.frameworks.test_tf_data import _data_lines

BODY = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
import tf_keras as keras
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).random((64, 4), dtype=np.float32)

class Rows(keras.utils.Sequence):
    def __len__(self):
        return 4

    def __getitem__(self, i):  # GETITEM
        return x[i * 16:(i + 1) * 16], x[i * 16:(i + 1) * 16, :1]

model = keras.Sequential([keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                          keras.layers.Dropout(0.2), keras.layers.Dense(1)])
model.compile(optimizer=OPTIMIZER, loss="mse")
model.fit(Rows(), epochs=2, verbose=0, workers=WORKERS)
model.evaluate(Rows(), verbose=0)
opt = keras.optimizers.legacy.SGD(0.1)
for i in range(3):  # a custom loop: apply_gradients with a zip
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - x[:, :1]) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
"""


def test_keras_2_steps_seeding_and_fit_workers_are_seen(tmp_path: Path) -> None:
    # fit with the new optimizer and workers, then a custom loop with a legacy one
    body = BODY.replace("OPTIMIZER", "'adam'").replace("WORKERS", "2")
    c, _ = run_script(tmp_path, body, op_steps=[1], header="")
    assert c.n_steps == 4 * 2 + 3  # fit's updates (evaluate makes none), the loop's
    assert UNSEEDED_TF_NOTE not in compare_pair(c, c).notes
    assert c.facts.get("keras.fit_workers") == 2
    assert _data_lines(c, 1) == {line_of(tmp_path, "# GETITEM")}


LEGACY_TF_KERAS = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is Keras 2 (tf_keras), imported lazily
import numpy as np
import tensorflow as tf
tf.keras.utils.set_random_seed(7)  # SEEDED
model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
model.compile(optimizer="sgd", loss="mse")
x = np.ones((8, 3), np.float32)
model.fit(x, x[:, :2], epochs=2, verbose=0)
"""


def test_the_seed_call_through_tf_keras_under_legacy_keras_is_seen(tmp_path: Path) -> None:
    # tf.keras.utils is tf_keras.api._v2.keras.utils there, another module than
    # tf_keras.utils: its set_random_seed went unrecorded, so the script was told it
    # "seeds neither TensorFlow nor Keras", and a clock-read seed was not the finding
    c, _ = run_script(tmp_path, LEGACY_TF_KERAS, header="")
    assert c.n_steps == 2
    assert UNSEEDED_TF_NOTE not in compare_pair(c, c).notes
    calls = seed_calls(c)
    assert [(api, site.rpartition(":")[2]) for api, site, _ in calls] == [
        ("keras.utils.set_random_seed", line_of(tmp_path, "# SEEDED"))]
    assert [value for _, _, value in next(iter(calls.values()))] == ["7"]
