"""A variable read that repeats an earlier read of the same captured variable in one traced
graph, with no possible write between, takes the earlier read's fingerprint instead of a
guarded hash of its own (tensorflow/reads.py); after a write to it, or a write through a
handle that could be any variable, reads are hashed again. The
fingerprints are those of the values read, worked out here on the host."""

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
u = tf.Variable(tf.zeros([6]), name="u")

@tf.function
def f(arg):  # called with v: TensorFlow traces a variable argument as that variable
    a = v.read_value() * 2.0
    b = v.read_value() + 1.0  # a repeat: nothing wrote v since the read above
    arg.assign_add(tf.ones([6]))  # writes v
    c = v.read_value() * 3.0  # after a write: hashed
    other = tf.identity(u.handle)  # a handle passed on inside the graph
    d = v.read_value() - 1.0  # a repeat of c
    tf.raw_ops.AssignAddVariableOp(resource=other, value=tf.ones([6]))
    e = v.read_value() + 2.0  # a write through that handle could be any variable: hashed
    return a + b + c + d + e

for _ in range(2):
    f(v)
    nondet.step()

from nondet import session
backend = next(b for b in session.current().backends if b.name == "tensorflow")
names = {sid: text for text, sid in session.current()._strings.items()}
reads = [op.alias is not None for op in backend.recorder.table
         if "variable read" in names[op.name_id]]
with open(__file__ + ".json", "w") as f:
    json.dump(reads, f)
"""


def _fp(values: np.ndarray) -> int:
    """A float32 vector's fingerprint as a read of it is recorded (content, dtype, device,
    shape)."""
    content = host_content([narrow_host_words(values)])
    return combine((content, name_code("float32"), name_code("cpu"), 1, values.size))


def test_repeated_reads_reuse_the_earlier_fingerprint(tmp_path: Path) -> None:
    c = capture(tmp_path, SCRIPT, op_steps=None)
    aliased = json.loads((tmp_path / "train.py.json").read_text())
    # reads of v in trace order (module docstring)
    assert aliased == [False, True, False, True, False]
    base = np.arange(6, dtype=np.float32)
    for step in (0, 1):
        reads = [r["out"] for r in records(c, step) if r["name"] == "variable:variable read"]
        before, after = base + step, base + step + 1
        assert reads == [_fp(before), _fp(before), _fp(after), _fp(after), _fp(after)]


AFTER_WRITES = """
import json
import nondet

v = tf.Variable(tf.range(6, dtype=tf.float32), name="v")
w = tf.Variable(tf.range(6, dtype=tf.float32), name="w")
u = tf.Variable(tf.zeros([6]), name="u")

@tf.function
def f(x, z):
    a = v.read_value() * 2.0
    v.assign_add(x * 3.0)  # a recorded value: derived from the argument
    b = v.read_value() + 1.0  # after that write: derived from a's read and x * 3
    c = v.read_value() - 1.0  # a repeat of b
    e = w.read_value() * 2.0
    w.assign_add(z * 3.0)
    g = w.read_value() + 1.0  # derived, as b
    h0 = u.read_value() * 2.0
    u.assign_add(tf.ones([6]))  # a value no record holds: the read after it is hashed
    h = u.read_value() * 3.0
    t = tf.tile(x, [2])  # derived from x
    return a + b + c + e + g + h0 + h + t[:6] + t[6:]

# the same x and z at step 0, another z at step 1 (v and w are equal before each write)
for z in (1.0, 2.0):
    f(tf.ones([6]), tf.fill([6], z))
    nondet.step()

from nondet import session
backend = next(b for b in session.current().backends if b.name == "tensorflow")
names = {sid: text for text, sid in session.current()._strings.items()}
reads = ["alias" if op.alias is not None else "derived" if op.derived else "hashed"
         for op in backend.recorder.table if "variable read" in names[op.name_id]]
with open(__file__ + ".json", "w") as f:
    json.dump(reads, f)
"""


def test_a_read_right_after_a_recorded_write_is_derived_from_it(tmp_path: Path) -> None:
    """tensorflow/reads.py, Note [Reads after a write]; and ``Tile``, derived from its input."""
    c = capture(tmp_path, AFTER_WRITES, op_steps=None)
    kinds = json.loads((tmp_path / "train.py.json").read_text())
    assert kinds == ["hashed", "derived", "alias", "hashed", "derived", "hashed", "hashed"]
    vector = (name_code("float32"), name_code("cpu"), 1, 6)
    found = {}
    for step in (0, 1):
        rows = records(c, step)
        reads = [r["out"] for r in rows if r["name"] == "variable:variable read"]
        a, b, c_, e, g, h0, h = reads
        inputs = [r["out"] for r in rows if r["name"] == "external:graph input"]
        x3 = next(r["out"] for r in rows if r["name"] == "Mul" and r["in"] == inputs[0])
        # b is the earlier read's and the written value's fingerprints, combined
        assert b == combine((a, x3, name_code("AssignAddVariableOp"), *vector)) == c_
        # a value no record holds: hashed, the content read
        assert (h0, h) == (_fp(np.full(6, step, np.float32)),
                           _fp(np.full(6, step + 1, np.float32)))
        tile = next(r for r in rows if r["name"] == "Tile")
        assert tile["out"] == combine((tile["in"], name_code("Tile"), name_code("float32"),
                                       name_code("cpu"), 1, 12))
        found[step] = (a, e, b, g)
    # equal values before equal writes read the same; a differing written value shows
    a, e, b, g = found[0]
    assert (a, b) == (e, g)
    a, e, b, g = found[1]
    assert a == e and b != g
