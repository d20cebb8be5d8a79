"""A variable's first read in a graph traced at the top level takes the content nondet knows
of the variable when the call starts (tensorflow/first_reads.py, Note [First reads]) instead
of a guarded hash; whatever may have written the variable since (an eager assignment, another
traced function) makes nondet hash it afresh. The fingerprints checked here are those of the
values read, worked out on the host; and ``MaxPool`` is derived from its input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from nondet.fingerprint import combine, host_content, name_code
from nondet.frameworks.fp import narrow_host_words
from tests.frameworks.test_tf_capture import capture, records

SCRIPT = """
import json
import nondet

v = tf.Variable(tf.range(6, dtype=tf.float32), name="v")
w = tf.Variable(tf.zeros([6]), name="w")

@tf.function
def step(x):
    a = v.read_value() * 2.0  # a first read: the value when the call starts
    b = w.read_value() + x  # likewise
    v.assign_add(tf.ones([6]))
    p = tf.nn.max_pool2d(tf.reshape(a + b, [1, 2, 3, 1]), 2, 1, "VALID")  # derived
    return tf.reduce_sum(p)

@tf.function
def bump():  # another traced function that writes w, before step 2's call
    w.assign_add(tf.fill([6], 10.0))

for s in range(4):
    if s == 1:
        v.assign(tf.fill([6], 7.0))  # an eager write after step 0's state hash
    if s == 2:
        bump()
    step(tf.ones([6]))
    nondet.step()

from nondet import session
backend = next(b for b in session.current().backends if b.name == "tensorflow")
names = {sid: text for text, sid in session.current()._strings.items()}
firsts = [op.first is not None for op in backend.recorder.table
          if "variable read" in names[op.name_id]]
with open(__file__ + ".json", "w") as f:
    json.dump(firsts, f)
"""


def _fp(values: np.ndarray) -> int:
    """A float32 vector's fingerprint as a read of it is recorded (content, dtype, device,
    shape)."""
    content = host_content([narrow_host_words(values)])
    return combine((content, name_code("float32"), name_code("cpu"), 1, values.size))


# What the two first reads (v, w) hold at the start of each step's call.
_V = [np.arange(6, dtype=np.float32), np.full(6, 7.0, np.float32),
      np.full(6, 8.0, np.float32), np.full(6, 9.0, np.float32)]
_W = [np.zeros(6, np.float32)] * 2 + [np.full(6, 10.0, np.float32)] * 2


@pytest.mark.parametrize("op_steps", [None, [1, 2, 3], [2, 3]])
def test_first_reads_take_the_value_the_call_started_with(tmp_path: Path,
                                                          op_steps: list[int] | None) -> None:
    """With every step captured (each step's state hash gives the contents), and with
    windows that open later (hashed afresh when they open); an eager assignment and a call
    of another traced function between two steps are seen as writes."""
    c = capture(tmp_path, SCRIPT, op_steps=op_steps)
    # both reads of ``step`` are first reads (``bump`` is not op-captured: no read there)
    assert json.loads((tmp_path / "train.py.json").read_text())[:2] == [True, True]
    for step in op_steps or range(4):
        reads = [r["out"] for r in records(c, step) if r["name"] == "variable:variable read"]
        assert reads == [_fp(_V[step]), _fp(_W[step])], step
        rows = records(c, step)
        pool = next(r for r in rows if r["name"] == "MaxPool")
        assert pool["out"] == combine((pool["in"], name_code("MaxPool"), name_code("float32"),
                                       name_code("cpu"), 4, 1, 1, 2, 1))


DATASET_WRITES = """
import json
import nondet

v = tf.Variable(tf.range(6, dtype=tf.float32), name="v")
counter = tf.Variable(0, name="counter")

def bumped(x):
    counter.assign_add(1)  # a tf.data function that writes a variable
    return x

batches = iter(tf.data.Dataset.from_tensors(tf.ones([6])).repeat().map(bumped))

@tf.function
def step(x):
    return tf.reduce_sum(v.read_value() * x)

for s in range(2):
    step(next(batches))
    nondet.step()

from nondet import session
backend = next(b for b in session.current().backends if b.name == "tensorflow")
names = {sid: text for text, sid in session.current()._strings.items()}
firsts = [op.first is not None for op in backend.recorder.table
          if "variable read" in names[op.name_id]]
with open(__file__ + ".json", "w") as f:
    json.dump(firsts, f)
"""


def test_a_dataset_function_that_writes_a_variable_keeps_reads_hashed(tmp_path: Path) -> None:
    """Its writes happen on tf.data's threads, at times no hook sees (module Note)."""
    c = capture(tmp_path, DATASET_WRITES, op_steps=None)
    assert json.loads((tmp_path / "train.py.json").read_text()) == [False]
    for step in (0, 1):
        reads = [r["out"] for r in records(c, step) if r["name"] == "variable:variable read"]
        assert reads == [_fp(np.arange(6, dtype=np.float32))]


FAILED_CALL = """
import nondet

v = tf.Variable(tf.range(6, dtype=tf.float32), name="v")

@tf.function
def step(x):
    a = v.read_value() * 2.0  # a first read
    written = v.assign_add(tf.ones([6]))
    with tf.control_dependencies([written]):
        x = tf.debugging.check_numerics(x, "bad input")  # fails after the write
    return tf.reduce_sum(a * x)

step(tf.ones([6]))
nondet.step()  # step 0: v is range + 1 after it
try:
    step(tf.fill([6], float("nan")))  # writes v (range + 2), then raises
except tf.errors.InvalidArgumentError:
    pass
step(tf.ones([6]))  # reads range + 2
nondet.step()  # step 1
"""


def test_a_call_that_raised_may_have_written_a_first_reads_variable(tmp_path: Path) -> None:
    """A traced call that raises is never collected (no op callback), but it may have
    written before it stopped: the next call's first read takes the value it wrote, not the
    one known from before it (Note [First reads])."""
    c = capture(tmp_path, FAILED_CALL, op_steps=None)
    for step, value in ((0, np.arange(6, dtype=np.float32)),
                        (1, np.arange(6, dtype=np.float32) + 2)):
        reads = [r["out"] for r in records(c, step) if r["name"] == "variable:variable read"]
        assert reads == [_fp(value)], step
