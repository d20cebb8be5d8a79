"""Every TensorFlow fixture through the real CLI: the exact finding, the fix id, the exit
code. The expected findings are declared by the fixtures (tests/e2e/fixture_cases.py)."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert found["localized"] and found["op_index"] is not None
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
