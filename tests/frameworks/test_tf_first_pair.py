"""The first pair of a TensorFlow diagnosis runs its training step uninstrumented (issue 15).

The default op window of a first pair is init and step 0, but the training step is traced
at step 0 and a traced graph keeps its guards for the rest of the run. A TensorFlow run may
decline step 0 (``Plan.ops_optional``): it keeps init's eager records, says so in the
capture's ``op_steps``, and graphs traced after the last op-captured step get no guards.
The step-level state hash runs eagerly the first time it sees a set of variables and traced
after that; the fingerprints must not depend on which.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest

tf = pytest.importorskip("tensorflow")

from nondet.frameworks.tensorflow import statehash  # noqa: E402
from nondet.frameworks.tensorflow.hashing import GraphHasher  # noqa: E402
from nondet.frameworks.tensorflow.state import TrackedVariable  # noqa: E402
from nondet.launch import CapturedRun, Plan, Target  # noqa: E402
from nondet.records import INIT_STEP, Group  # noqa: E402
from nondet.store import Capture, open_capture  # noqa: E402
from tests.frameworks.test_tf_capture import CUSTOM_LOOP, HEADER  # noqa: E402

# After training: how many guard ``If`` ops the traced step holds.
COUNT_GUARDS = """
graph = train_step.get_concrete_function(x, y).graph
guards = sum(op.type == "If" for op in graph.get_operations())
with open(__file__ + ".guards", "w") as f:
    f.write(str(guards))
"""


def _run(tmp_path: Path, plan: Plan) -> tuple[Capture, int]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "train.py"
    script.write_text(HEADER + CUSTOM_LOOP + COUNT_GUARDS)
    run = CapturedRun(Target(str(script), None, ()), plan, 0, tmp_path / "out")
    run.start()
    result = run.wait(timeout=600)
    assert result.status == "complete", result.log_tail()
    assert not result.hook_error, result.hook_error
    return open_capture(result.path), int((tmp_path / "train.py.guards").read_text())


def test_a_first_pair_keeps_init_and_traces_its_step_without_guards(tmp_path: Path) -> None:
    window = [INIT_STEP, 0]
    declined, guards = _run(tmp_path / "first", Plan("a", window, ops_optional=True))
    assert json.loads(str(declined.attrs["op_steps"])) == [INIT_STEP]  # says what it did
    assert declined.op_steps() == [INIT_STEP]  # init's eager ops were recorded, step 0's not
    assert guards == 0
    assert declined.n_steps == 3 and all(declined.steps["loss_fp"][1:])  # steps still seen
    # the same window, not optional: step 0 is captured, so the step is traced with guards
    full, full_guards = _run(tmp_path / "full", Plan("a", window))
    assert full.op_steps() == window and full_guards > 0
    # (their step fingerprints need not match: guards change which ops TensorFlow fuses;
    # the two runs of a pair always have the same plan)


EAGER_LOOP = """
model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh"),
                             tf.keras.layers.Dense(1)])
model.build((None, 4))
opt = tf.keras.optimizers.SGD(0.1)
x, y = tf.random.normal([16, 4]), tf.random.normal([16, 1])
for _ in range(3):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
"""


def test_a_first_pair_that_trains_eagerly_keeps_step_0(tmp_path: Path) -> None:
    """Nothing is traced, so nothing makes op-level capture dear: the optional window is
    kept whole and a difference at step 0 is found without a second pair."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "train.py"
    script.write_text(HEADER + EAGER_LOOP)
    run = CapturedRun(Target(str(script), None, ()),
                      Plan("a", [INIT_STEP, 0], ops_optional=True), 0, tmp_path / "out")
    run.start()
    result = run.wait(timeout=600)
    assert result.status == "complete", result.log_tail()
    assert not result.hook_error, result.hook_error
    capture = open_capture(result.path)
    assert capture.op_steps() == [INIT_STEP, 0]
    assert "MatMul" in {capture.string(int(i)) for i in capture.ops(0)["name"]}
    assert capture.n_steps == 3


def _tracked() -> list[tuple[TrackedVariable, object]]:
    gen = tf.random.Generator.from_seed(3)
    values = [
        (Group.PARAM, tf.Variable(gen.normal([7, 5]), name="w")),
        (Group.PARAM, tf.Variable(gen.normal([5]), name="b")),
        (Group.BUFFER, tf.Variable(tf.range(9, dtype=tf.int32), name="count")),
        (Group.OPTIM, tf.Variable(gen.normal([7, 5], dtype=tf.float64), name="m")),
    ]
    return [(TrackedVariable(weakref.ref(v), v.name, "", group), v) for group, v in values]


def _summary(state: statehash.StepState) -> tuple[object, ...]:
    def exact(x: float) -> str:  # NaN (no sum for integers) compares equal to itself here
        return float(x).hex()

    return (state.params, state.buffers, state.optim, exact(state.params_sum),
            [(r.name, r.fp, exact(r.total), exact(r.maxabs), r.numel) for r in state.tensors])


@pytest.mark.parametrize("detailed", [True, False])
def test_eager_and_traced_state_fingerprints_are_equal(detailed: bool) -> None:
    hasher = statehash.StateHasher(GraphHasher())
    tracked = _tracked()
    eager = hasher.state(tracked, detailed)
    assert list(hasher._functions.values()) == [None]  # the first call ran eagerly
    traced = hasher.state(tracked, detailed)
    assert all(f is not None for f in hasher._functions.values())  # the second traced it
    assert _summary(eager) == _summary(traced)
    assert eager.params and eager.buffers and eager.optim
    assert len(eager.tensors) == (4 if detailed else 0)
    tracked[0][1].assign_add(tf.ones([7, 5]))  # a change shows in the traced path too
    assert hasher.state(tracked, detailed).params != traced.params

