"""Every TensorFlow fixture through the real CLI: the exact finding, the fix id, the exit
code. The expected findings are declared by the fixtures (tests/e2e/fixture_cases.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES, REPO, run_cli
from tests.e2e.fixture_cases import (
    Case,
    cases,
    check_declarations,
    check_finding,
    check_verified,
    intervention_to_verify,
    run_case,
)

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.e2e, pytest.mark.tensorflow]

CASES = cases(FIXTURES / "tensorflow")


def test_every_fixture_declares_its_expectation() -> None:
    check_declarations(FIXTURES / "tensorflow", CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fixture(case: Case, tmp_path: Path) -> None:
    intervention = intervention_to_verify(case)
    result, report = run_case(case, tmp_path, verify=intervention is not None)
    found = check_finding(case, result, report)
    if intervention is not None:
        check_verified(intervention, result, report)
    if found is None:
        return
    assert found["localized"]
    if found["op_index"] is None:
        # data named at its line from the first pair's step rows, as the op records of a
        # re-run name it: no narrowing runs (frameworks/tensorflow/entries.py)
        assert found["kind"] == "entry" and found["source"]
        assert report is not None
        assert not any("-ops" in Path(c).name for c in report["captures"])
    if found["kind"] == "op":
        # graph outputs are hashed in the graph: the report says sizes were not measured
        assert found["mismatched_elements"] is None
        assert "sizes are not measured for TensorFlow ops" in found["notes"]


def test_capture_does_not_make_a_deterministic_conv_net_diverge(tmp_path: Path) -> None:
    # The benchmark's Keras CNN repeats exactly when run plainly. Capture once made it
    # diverge within a few steps: lowered tf.cond guards held tensors for a timing-dependent
    # while, which changed which input buffer AddN reused and so its summation order
    # (tensorflow/ops.py, Note [Graph instrumentation]).
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "bench/model_tf.py",
                     "--steps", "8", cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("nondet: deterministic"), result.stdout


EAGER_NOISE = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh"),
                             tf.keras.layers.Dense(1)])
model.build((None, 4))
opt = tf.keras.optimizers.SGD(0.1)
rng = np.random.default_rng()  # unseeded: the runs differ from step 0 on
y = tf.zeros([16, 1])
for _ in range(3):
    x = tf.constant(rng.normal(size=(16, 4)).astype(np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
"""


def test_an_eager_script_that_differs_at_step_0_needs_no_second_pair(tmp_path: Path) -> None:
    # Nothing is traced, so the first pair keeps step 0 op by op (no guards to pay for) and
    # finds the entry there itself: no narrowing runs (issue 15).
    script = tmp_path / "eager_noise.py"
    script.write_text(EAGER_NOISE)
    report = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"),
                     "--json", str(report), str(script))
    assert result.returncode == 1, result.stdout + result.stderr
    data = json.loads(report.read_text())
    found = data["first_divergence"]
    assert (found["step"], found["kind"], found["localized"]) == (0, "entry", True)
    assert [Path(c).name for c in data["captures"]] == ["run-a.h5", "run-b.h5"]


TRACED_NOISE = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="tanh"),
                             tf.keras.layers.Dense(1)])
opt = tf.keras.optimizers.Adam(0.01)
rng = np.random.default_rng()  # unseeded: the runs differ from step 0 on


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


for _ in range(6):
    x = rng.normal(size=(16, 4)).astype(np.float32)
    train_step(tf.constant(x), tf.zeros([16, 1]))  # ENTRY
"""

FIT_SHUFFLED = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="tanh"),
                             tf.keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
x = np.random.default_rng(0).normal(size=(128, 4)).astype(np.float32)
y = x.sum(axis=1, keepdims=True)
order = np.random.default_rng().permutation(len(x))  # unseeded: the batches differ
model.fit(x[order], y[order], batch_size=16, epochs=1, shuffle=False, verbose=0)  # FIT
"""


def _line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if marker in line)


def _run_script(tmp_path: Path, text: str) -> dict[str, Any]:
    script = tmp_path / "train.py"
    script.write_text(text)
    report = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"),
                     "--json", str(report), str(script))
    assert result.returncode == 1, result.stdout + result.stderr
    return dict(json.loads(report.read_text()))


def test_a_traced_step_fed_numpy_data_that_differs_at_step_0_needs_no_second_pair(
        tmp_path: Path) -> None:
    # tf.constant(x) of a NumPy array, passed to the tf.function: the first pair runs the
    # traced step uninstrumented, and its step rows name the graph input at the line the
    # op records of a re-run name it (issue 15).
    data = _run_script(tmp_path, TRACED_NOISE)
    found = data["first_divergence"]
    assert (found["step"], found["kind"], found["entry_kind"], found["op"]) == (
        0, "entry", "external", "graph input")
    assert found["source"].endswith(f"train.py:{_line(TRACED_NOISE, '# ENTRY')}")
    assert [Path(c).name for c in data["captures"]] == ["run-a.h5", "run-b.h5"]
    assert data["suggestions"][0]["id"] == "PY-NP-GENERATOR"


def test_keras_fit_on_numpy_arrays_shuffled_unseeded_needs_no_second_pair(
        tmp_path: Path) -> None:
    data = _run_script(tmp_path, FIT_SHUFFLED)
    found = data["first_divergence"]
    assert (found["step"], found["kind"], found["entry_kind"], found["op"]) == (
        0, "entry", "tf_data", "IteratorGetNext")
    assert found["source"].endswith(f"train.py:{_line(FIT_SHUFFLED, '# FIT')}")
    assert [Path(c).name for c in data["captures"]] == ["run-a.h5", "run-b.h5"]


EARLIER_OP = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import concurrent.futures as cf
import time
import numpy as np
import tensorflow as tf
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="tanh"),
                             tf.keras.layers.Dense(1)])
opt = tf.keras.optimizers.SGD(0.01)
data = np.random.default_rng(0).normal(size=(4, 4096, 4)).astype(np.float32)


def racy_center(a):  # float32 sums added in thread-completion order
    def part(chunk):
        time.sleep(0.0002)
        return chunk.sum(axis=0, dtype=np.float32)
    acc = np.zeros(a.shape[1], np.float32)
    with cf.ThreadPoolExecutor(4) as pool:
        for done in cf.as_completed([pool.submit(part, c) for c in np.array_split(a, 64)]):
            acc += done.result()
    return (a - acc / np.float32(len(a))).astype(np.float32)


@tf.function
def prep(x):
    return tf.numpy_function(racy_center, [x], tf.float32)  # OP


@tf.function
def train_step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


for step in range(4):
    centered = prep(tf.constant(data[step])).numpy()  # through the host
    train_step(tf.constant(centered))
"""


def test_an_input_an_earlier_op_of_its_step_made_differ_is_narrowed_to_that_op(
        tmp_path: Path) -> None:
    # The control of the order rule: train_step's input is made from host data, but from
    # values a racy op of the same step computed; the op records name that op first, so
    # the step rows must not name the input (Note [Entries named like the op records]).
    data = _run_script(tmp_path, EARLIER_OP)
    found = data["first_divergence"]
    assert (found["step"], found["kind"], found["op"]) == (0, "op", "PyFunc")
    assert found["source"].endswith(f"train.py:{_line(EARLIER_OP, '# OP')}")
    assert "run-a-ops.h5" in [Path(c).name for c in data["captures"]]
