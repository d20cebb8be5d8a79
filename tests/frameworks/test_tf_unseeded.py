"""A TensorFlow script that never seeds repeats under nondet (which seeds Python, NumPy
and TensorFlow for it) but not on its own: the report must say so, not only
"deterministic"."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from nondet.analysis import compare_pair
from nondet.seed_diff import KERAS_PYTHON_SEED_NOTE, PYTHON_SEEDED_TF_NOTE, UNSEEDED_TF_NOTE
from tests.frameworks.test_tf_capture import line_of, run_script

BODY = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras
import numpy as np
{seed}
x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(x, x[:, :1], batch_size=32, epochs=1, verbose=0)
"""


@pytest.mark.parametrize("seed, noted", [
    ("", UNSEEDED_TF_NOTE),  # only a NumPy generator seeded: Keras draws from Python's random
    ("keras.utils.set_random_seed(1)", None),
    # h-realtf2: TensorFlow seeded alone; Keras 3 still seeds the Dense initializer from
    # Python's random, so plain runs differ (was: no note)
    ("import tensorflow as tf; tf.random.set_seed(1)", KERAS_PYTHON_SEED_NOTE),
    ("import tensorflow as tf, random; tf.random.set_seed(1); random.seed(1)", None),
    # TensorFlow round 11: Python's random seeded, TensorFlow not: the Keras layers repeat
    # on their own, so "draws new ones each time" was untrue; only TF's own ops would
    ("import random; random.seed(1)", PYTHON_SEEDED_TF_NOTE),
])
def test_a_script_that_never_seeds_tensorflow_is_told_so(
        tmp_path: Path, seed: str, noted: str | None) -> None:
    capture, _ = run_script(tmp_path, BODY.format(seed=seed), header="")
    report = compare_pair(capture, capture)
    assert report.verdict == "deterministic"
    told = [n for n in report.notes
            if n in (UNSEEDED_TF_NOTE, KERAS_PYTHON_SEED_NOTE, PYTHON_SEEDED_TF_NOTE)]
    assert told == ([noted] if noted else [])
    assert not [n for n in report.notes if "before the script seeds it" in n]


EARLY = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras
import numpy as np
import tensorflow as tf
x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
kept = keras.layers.Dense(1, kernel_initializer=keras.initializers.Ones())  # no draw
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])  # MODEL
noise = tf.random.normal((64, 4))  # NOISE
keras.utils.set_random_seed(1)  # SEED
x = x + 0.01 * noise.numpy()
model.compile("sgd", "mse")
model.fit(x, x[:, :1], batch_size=32, epochs=1, verbose=0, shuffle=True)
"""


def test_randomness_drawn_before_the_script_seeds_is_noted(tmp_path: Path) -> None:
    """h-realtf round 7: a model built (and a tf.random op run) before the script's
    keras.utils.set_random_seed differ between plain runs, while nondet's runs, seeded
    before the script starts, match: "deterministic" alone hid it (no note before)."""
    capture, _ = run_script(tmp_path, EARLY, header="")
    report = compare_pair(capture, capture)
    assert report.verdict == "deterministic"
    early = [n for n in report.notes if "before the script seeds it" in n]
    model, noise, seed = (line_of(tmp_path, m) for m in ("# MODEL", "# NOISE", "# SEED"))
    assert len(early) == 2, report.notes
    keras_note, tf_note = sorted(early, key=lambda n: "TensorFlow random op" in n)
    assert f"train.py:{model} Keras drew a default seed" in keras_note
    assert f"keras.utils.set_random_seed at {tmp_path / 'train.py'}:{seed}" in keras_note
    assert f"train.py:{noise} a TensorFlow random op" in tf_note
