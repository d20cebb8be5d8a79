"""Scripts that use torch.func transforms (``grad``, ``vmap`` with ``functional_call``):
a model called inside a transform sees functorch wrappers for parameters, tensors with no
memory of their own (Note [torch.func wrappers] in nondet/frameworks/torch/leaves.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from nondet.launch import CapturedRun
from nondet.runspec import Plan, Target
from nondet.store import open_capture
from tests.conftest import run_cli

FIRST_CALL_IN_GRAD = """
    import sys
    import numpy as np
    import torch
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(32, 8)
    rng = np.random.default_rng() if "--noise" in sys.argv else None

    def loss_of(params, batch):
        return functional_call(model, params, (batch,)).pow(2).mean()

    # Per-example gradient norms before training: the model's first call is inside vmap and
    # grad, so the run's first step boundary reads parameters that are functorch wrappers.
    norms = vmap(grad(loss_of), in_dims=(None, 0))(dict(model.named_parameters()), x[:, None])
    for step in range(3):
        loss = loss_of(dict(model.named_parameters()), x)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                noise = 0 if rng is None else torch.from_numpy(
                    rng.normal(0, 1e-3, p.shape).astype("float32"))
                p -= 0.1 * p.grad + noise
                p.grad = None
    """


def test_state_read_inside_a_transform_is_the_wrapped_values(tmp_path: Path) -> None:
    """The first step boundary came inside ``vmap(grad(...))``: reading the parameters'
    memory raised ("Cannot access data pointer of Tensor that doesn't have storage"), the
    hook error ended ``nondet run`` with an internal error (exit 3)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FIRST_CALL_IN_GRAD))
    for op_steps in ([], None):  # step-level, and every op recorded
        run = CapturedRun(Target(str(script), None, ()), Plan("t", op_steps), 0,
                          tmp_path / f"out-{op_steps is None}")
        run.start()
        result = run.wait()
        assert result.status == "complete" and not result.hook_error, result.log_tail()
        assert open_capture(result.path).n_steps == 3


def test_a_transformed_script_repeats_and_its_noise_is_found(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FIRST_CALL_IN_GRAD))
    quiet = run_cli("run", "-q", "--out", str(tmp_path / "a"), str(script), cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    noisy = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "b"), str(script),
                    "--noise", cwd=tmp_path)
    assert noisy.returncode == 1, noisy.stdout + noisy.stderr
    assert "train.py:23" in noisy.stdout and "PY-NP-GENERATOR" in noisy.stdout


#: A functional training loop: parameters kept in a dict and replaced at every step (as
#: torchopt's functional optimizers do), gradients from torch.autograd.grad, no optimizer
#: and no backward; ``--noise`` adds an unseeded generator's noise to every batch.
FUNCTIONAL_LOOP = """
    import sys
    import numpy as np
    import torch
    import nondet
    from torch.func import functional_call

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    rng = np.random.default_rng() if "--noise" in sys.argv else np.random.default_rng(0)
    x, y = torch.randn(256, 8), torch.randn(256, 1)
    for step in range(12):
        idx = torch.randint(0, 256, (32,))
        xb = x[idx] + torch.from_numpy(rng.normal(0, 0.01, (32, 8)).astype("float32"))
        loss = torch.nn.functional.mse_loss(functional_call(net, params, (xb,)), y[idx])
        grads = torch.autograd.grad(loss, tuple(params.values()))
        params = {k: (p - 0.05 * g).detach().requires_grad_()
                  for (k, p), g in zip(params.items(), grads)}
        if "--marked" in sys.argv:
            nondet.step()
    print(sum(float(p.sum()) for p in params.values()))
    """


def test_a_functional_loop_is_compared_by_the_loss_it_differentiates(tmp_path: Path) -> None:
    """Trial round 20 (torchopt's functional adam): the steps held no state nondet could
    see (parameters in a dict, replaced at every step; no backward, no optimizer), so the
    noise in every batch was "a difference that never reached training", verdict
    deterministic. The loss torch.autograd.grad differentiates is now the step's loss
    (Note [Losses of torch.autograd.grad]); the seeded control must stay quiet."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FUNCTIONAL_LOOP))
    quiet = run_cli("run", "-q", "--out", str(tmp_path / "a"), str(script), "--marked",
                    cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    noisy = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "b"), str(script),
                    "--marked", "--noise", cwd=tmp_path)
    assert noisy.returncode == 1, noisy.stdout + noisy.stderr
    assert "train.py:15" in noisy.stdout and "PY-NP-GENERATOR" in noisy.stdout


def test_runs_with_no_step_whose_values_differ_are_not_called_deterministic(
        tmp_path: Path) -> None:
    """The same loop without nondet.step(): no step in either run, and values that already
    differ. It was "deterministic — 2 runs (0, 0 steps)"; no step is never exit 0 (DESIGN),
    and the line names what differed."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FUNCTIONAL_LOOP))
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "a"), str(script),
                     "--noise", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no training step was observed" in result.stderr
    assert "torch.from_numpy at train.py:15" in result.stderr
