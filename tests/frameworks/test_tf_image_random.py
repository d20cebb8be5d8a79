"""Stateful tf.image.random_* ops (frameworks/tensorflow/image_random.py): where a script
calls them, the fix they select, and the stateless stand-in that verifies it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import pytest

pytest.importorskip("tensorflow")

from nondet import interventions, recipe
from nondet.frameworks.tensorflow.image_random import FACT
from tests.frameworks.test_tf_capture import line_of, run_script
from tests.frameworks.test_tf_data import _data_lines

LOOP = """
w = tf.Variable(tf.ones((48, 1)))
opt = tf.keras.optimizers.SGD(0.1)
for a, b in ds:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((tf.reshape(a - b, (-1, 48)) @ w) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
"""

PIPELINE = """
images = tf.random.stateless_uniform((32, 4, 4, 3), seed=(1, 2))

def view(x):
    x = tf.image.random_flip_left_right(x)  # FLIP
    return tf.image.random_brightness(x, 0.3)  # BRIGHT

ds = tf.data.Dataset.from_tensor_slices(images).map(  # MAP
    lambda x: (view(x), view(x)), num_parallel_calls=4).batch(8)
"""


def test_a_map_calling_stateful_image_ops_names_them(tmp_path: Path) -> None:
    c, _ = run_script(tmp_path, dedent(PIPELINE) + LOOP, op_steps=[1])
    # autograph converts the map function (its frames are generated files): TensorFlow's
    # stack maps them back to the lines calling the ops
    train = tmp_path / "train.py"
    assert c.facts.get(FACT) == [
        f"{train}:{line_of(tmp_path, '# FLIP')} (tf.image.random_flip_left_right)",
        f"{train}:{line_of(tmp_path, '# BRIGHT')} (tf.image.random_brightness)"]
    # the batches that differ are named at the first stateful call inside the function
    assert _data_lines(c, 1) == {line_of(tmp_path, "# FLIP")}


def test_an_eager_call_names_its_own_line(tmp_path: Path) -> None:
    body = """
    x = tf.image.random_flip_up_down(tf.ones((4, 4, 1)))  # EAGER
    x = tf.image.stateless_random_flip_up_down(x, seed=(1, 2))
    ds = tf.data.Dataset.from_tensor_slices(tf.ones((16, 4, 4, 3))).map(
        lambda x: (x, tf.image.stateless_random_flip_left_right(x, seed=(3, 4)))).batch(8)
    """
    c, _ = run_script(tmp_path, dedent(body) + LOOP, op_steps=[1])
    line = line_of(tmp_path, "# EAGER")
    assert c.facts.get(FACT) == [f"{tmp_path / 'train.py'}:{line} (tf.image.random_flip_up_down)"]


def test_stateless_ops_alone_record_nothing(tmp_path: Path) -> None:
    body = """
    ds = tf.data.Dataset.from_tensor_slices(tf.ones((16, 4, 4, 3))).map(
        lambda x: (x, tf.image.stateless_random_flip_left_right(x, seed=(3, 4))),
        num_parallel_calls=4).batch(8)
    """
    c, _ = run_script(tmp_path, dedent(body) + LOOP, op_steps=[1])
    assert FACT not in c.facts


def test_stateful_image_ops_in_a_batch_are_fixed_by_their_stateless_twins_first() -> None:
    facts = {"framework": "tensorflow", "kind": "entry", "entry_kind": "tf_data",
             "phase": "data", "op": "IteratorGetNext", "tensorflow_version": "2.21.0",
             "keras_version": "3.15.1", FACT: True}
    site = "simclr.py:40 (tf.image.random_flip_left_right)"
    first, *rest = recipe.suggest(facts, sites={FACT: [site]})
    assert first.recipe.id == "TF-IMAGE-STATEFUL"
    assert "stateless_random_flip_left_right" in first.fix
    assert first.recipe.apply[0] == "tf.image_stateless"
    assert first.details == [f"stateful op called at {site}"]
    assert "TF-DATA" in [s.recipe.id for s in rest]  # the global switch stays offered
    without = recipe.suggest({**facts, FACT: False})
    assert "TF-IMAGE-STATEFUL" not in [s.recipe.id for s in without]


# A parallel map of stateful tf.image ops, as a SimCLR pipeline builds its two views; the
# script prints its batches' digest, and whether the two views and the input differ.
_RACE = """
import hashlib, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
from nondet import interventions
os.environ[interventions.APPLY_ENV] = sys.argv[1]
interventions.apply_requested(7)
tf.random.set_seed(0)
images = tf.random.stateless_uniform((256, 12, 12, 3), seed=(1, 2))

def view(x):
    x = tf.image.random_flip_left_right(x)
    x = tf.image.random_brightness(x, 0.3)
    return tf.image.random_crop(x, (8, 8, 3))

ds = tf.data.Dataset.from_tensor_slices(images).map(
    lambda x: (view(x), view(x)), num_parallel_calls=4).batch(32)
h, views_differ = hashlib.sha256(), False
for a, b in ds:
    h.update(a.numpy().tobytes()); h.update(b.numpy().tobytes())
    views_differ |= bool(tf.reduce_any(a != b))
print(h.hexdigest(), views_differ)
"""


def _race(tmp_path: Path, apply: str) -> str:
    script = tmp_path / "race.py"
    script.write_text(_RACE)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(script), apply], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path, env={"PYTHONPATH": str(root),
                                                         "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_stateless_stand_in_makes_a_parallel_map_repeat(tmp_path: Path) -> None:
    assert interventions.TABLE["tf.image_stateless"].how == "patch"
    runs = {_race(tmp_path, "tf.image_stateless") for _ in range(3)}
    assert len(runs) == 1, runs
    _digest, views_differ = runs.pop().split()
    assert views_differ == "True"  # two calls on one image still draw differently
