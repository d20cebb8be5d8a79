"""A TensorFlow script that never seeds repeats under nondet (which seeds Python, NumPy
and TensorFlow for it) but not on its own: the report must say so, not only
"deterministic"."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from nondet.analysis import compare_pair
from nondet.seed_diff import KERAS_PYTHON_SEED_NOTE, UNSEEDED_TF_NOTE
from tests.frameworks.test_tf_capture import run_script

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
])
def test_a_script_that_never_seeds_tensorflow_is_told_so(
        tmp_path: Path, seed: str, noted: str | None) -> None:
    capture, _ = run_script(tmp_path, BODY.format(seed=seed), header="")
    report = compare_pair(capture, capture)
    assert report.verdict == "deterministic"
    told = [n for n in report.notes if n in (UNSEEDED_TF_NOTE, KERAS_PYTHON_SEED_NOTE)]
    assert told == ([noted] if noted else [])
