"""The backend contract (tests/frameworks/contract.py) on every framework nondet supports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.frameworks import contract

TORCH = contract.ContractScript(steps=4, source="""
    import numpy as np
    import torch
    {inject}
    import nondet
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = np.random.default_rng(0).normal(size=(4, 16, 4)).astype("float32")
    for step in range(4):
        x = torch.from_numpy(data[step])
        loss = model(x).pow(2).mean()
        nondet.probe(loss, "contract")
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("weights", [round(float(p.sum()), 6) for p in model.parameters()])
    """)

TENSORFLOW = contract.ContractScript(steps=4, source="""
    import numpy as np
    import tensorflow as tf
    {inject}
    import keras
    import nondet
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(0.01)
    data = np.random.default_rng(0).normal(size=(4, 16, 4)).astype("float32")
    dataset = iter(tf.data.Dataset.from_tensor_slices(data))
    for step in range(4):
        x = next(dataset)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        nondet.probe(loss, "contract")
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    print("weights", [round(float(tf.reduce_sum(v)), 6) for v in model.trainable_variables])
    """)

FRAMEWORKS = [
    pytest.param(TORCH, id="torch", marks=pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="torch not installed")),
    pytest.param(TENSORFLOW, id="tensorflow", marks=[pytest.mark.tensorflow, pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None, reason="tensorflow not installed")]),
]


@pytest.mark.parametrize("script", FRAMEWORKS)
def test_step_rows_and_probes(script: contract.ContractScript, tmp_path: Path) -> None:
    c = contract.capture(tmp_path, script, op_steps=[-1, 0])
    contract.check_step_rows(c, script)
    contract.check_probes(c)


@pytest.mark.e2e
@pytest.mark.parametrize("script", FRAMEWORKS)
def test_hook_error_is_nondets_and_leaves_the_script_alone(script: contract.ContractScript,
                                                           tmp_path: Path) -> None:
    contract.check_hook_error(tmp_path, script)
