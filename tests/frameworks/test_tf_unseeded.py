"""A TensorFlow script that never seeds repeats under nondet (which seeds Python, NumPy
and TensorFlow for it) but not on its own: the report must say so, not only
"deterministic"."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from nondet.analysis import compare_pair
from nondet.seed_diff import UNSEEDED_TF_NOTE
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
    ("", True),  # only a NumPy generator seeded: Keras draws its init from Python's random
    ("keras.utils.set_random_seed(1)", False),
    ("import tensorflow as tf; tf.random.set_seed(1)", False),
])
def test_a_script_that_never_seeds_tensorflow_is_told_so(
        tmp_path: Path, seed: str, noted: bool) -> None:
    capture, _ = run_script(tmp_path, BODY.format(seed=seed), header="")
    report = compare_pair(capture, capture)
    assert report.verdict == "deterministic"
    assert (UNSEEDED_TF_NOTE in report.notes) is noted
