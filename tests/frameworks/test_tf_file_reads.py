"""TensorFlow and Keras read checkpoints, weights files and tf.data caches in C:
``file_reads`` reports them to ``readback`` (round 7: the later runs resumed from the first
pair's ``ck.weights.h5``, and a pair met in a ``Dataset.cache`` file, with nothing said)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from nondet import readback
from tests.test_readback import _run

CODE = """
import keras
import tensorflow as tf
from nondet.frameworks.tensorflow import file_reads
ck = tf.train.Checkpoint(v=tf.Variable(1.0))
saved = ck.write('ckpt/last')
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.save_weights('w.weights.h5')  # h5py: written and read in C
earlier = float(sys.argv[1]) - 5  # as if an earlier run of the invocation wrote them
for name in [os.path.join('ckpt', n) for n in os.listdir('ckpt')] + ['w.weights.h5']:
    os.utime(name, (earlier, earlier))
file_reads.install()
file_reads.install_keras()
ck.restore(saved)
model.load_weights('w.weights.h5')
list(tf.data.Dataset.range(4).cache('dcache'))
list(tf.data.Dataset.range(4).cache())  # in memory: no file
"""


def test_checkpoint_restore_and_dataset_cache_reach_readback(tmp_path: Path) -> None:
    now = time.time()
    facts = _run(tmp_path, CODE, run_started=now, invocation=now - 20)
    index = os.path.join("ckpt", "last.index")
    assert facts == {f"capture_note.{readback.FACT}:{index}": readback.note_text(index),
                     f"capture_note.{readback.FACT}:w.weights.h5":
                         readback.note_text("w.weights.h5"),
                     readback.CACHE_FACT: ["dcache"]}
