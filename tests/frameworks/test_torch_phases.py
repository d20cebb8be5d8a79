"""Phases in loops that are not one forward, one backward, one update per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nondet.store import Capture
from tests.frameworks.test_torch_capture import capture, records


def test_gradient_accumulation_micro_batches_are_forward_not_optimizer(tmp_path: Path) -> None:
    # nanoGPT / Trainer(gradient_accumulation_steps=2): the second micro-batch's forward
    # runs after the first backward and before optimizer.step(); it is a forward (a finding
    # there named "optimizer" would be matched against the wrong recipes)
    c = capture(tmp_path, """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            for micro in range(2):
                loss = model(torch.ones(2, 4) * micro).sum() / 2   # line 8
                loss.backward()
            opt.step()                                            # line 10
            opt.zero_grad()
        """)
    rows = records(c, 0)
    # the model's ops (those with a module) of both micro-batches; the input made before
    # the call stays in "optimizer" (from the end of a backward to the update, as documented)
    model_ops = [(name, phase) for name, phase, module, line, _ in rows
                 if line == "8" and module and not name.startswith("external:")]
    forward = [name for name, phase in model_ops if phase == "forward"]
    assert forward.count("aten.addmm.default") == 2, model_ops
    assert {phase for _, phase in model_ops} == {"forward", "backward"}, model_ops
    assert {phase for _, phase, _, line, _ in rows if line == "10"} == {"optimizer"}


def test_a_forward_inside_an_optimizer_closure_is_forward(tmp_path: Path) -> None:
    # Lightning's automatic optimization runs training_step and backward in a closure that
    # optimizer.step(closure) calls (LBFGS scripts do the same): the model's ops are a
    # forward, not the optimizer's (they were all "optimizer" before)
    c = capture(tmp_path, """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def closure():
            opt.zero_grad()
            loss = model(torch.ones(2, 4)).sum()   # line 9
            loss.backward()
            return loss

        for _ in range(2):
            opt.step(closure)
        """)
    rows = records(c, 0)
    phases = {name: phase for name, phase, module, line, _ in rows
              if line == "9" and module and not name.startswith("external:")}
    assert phases.get("aten.addmm.default") == "forward", rows
    assert phases.get("aten.tanh.default") == "forward", rows



NESTED_STEPS = """
    import collections
    import torch
    torch.manual_seed(0)

    def sgd(params):
        for p in params:
            p.add_(p.grad, alpha=-0.1)

    class Plain(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self, closure=None):
            sgd(self.param_groups[0]["params"])

    class Wrapper(torch.optim.Optimizer):
        # its step scales the gradients, runs its inner optimizer's step, then changes the
        # parameters again: ZeRO broadcasts the shards its local optimizer updated, LARS
        # rescales, Lookahead averages
        def __init__(self, params):
            params = list(params)
            self.inner = Plain(params)
            INIT

        @torch.no_grad()
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                p.grad.mul_(2)
            self.inner.step()
            for p in self.param_groups[0]["params"]:
                p.mul_(0.5)

    class Flat(torch.optim.Optimizer):
        # the same update in one optimizer
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self, closure=None):
            params = self.param_groups[0]["params"]
            for p in params:
                p.grad.mul_(2)
            sgd(params)
            for p in params:
                p.mul_(0.5)

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    opt = OPTIMIZER(model.parameters())
    for i in range(3):
        loss = model(torch.ones(2, 4) * (i + 1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    """

# How a wrapper starts decides whether torch hooks its step (then its step and its inner
# optimizer's each run the global step hooks):
# - ZeroRedundancyOptimizer calls Optimizer.__init__: hooked;
# - Lookaheads that keep torch's hook dicts (pytorch_optimizer's) do not call it:
#   Optimizer.zero_grad hooks their step when first called;
# - accelerate's AcceleratedOptimizer does neither and has its own zero_grad: never hooked.
HOOKED = "super().__init__(params, {})"
HOOKED_BY_ZERO_GRAD = """self.param_groups, self.defaults, self.state = \\
                self.inner.param_groups, self.inner.defaults, self.inner.state
            self._optimizer_step_pre_hooks = collections.OrderedDict()
            self._optimizer_step_post_hooks = collections.OrderedDict()"""
NEVER_HOOKED = """self.param_groups, self.defaults, self.state = \\
                self.inner.param_groups, self.inner.defaults, self.inner.state
            self.zero_grad = self.inner.zero_grad"""


def _nested(init: str) -> str:
    return NESTED_STEPS.replace("OPTIMIZER", "Wrapper").replace("INIT", init)


def _step_fields(c: Capture, field: str) -> list[int]:
    return [int(c.step_row(s)[field]) for s in range(c.n_steps)]  # type: ignore[index]


@pytest.mark.parametrize("init", [HOOKED, HOOKED_BY_ZERO_GRAD], ids=["zero", "lookahead"])
def test_an_optimizer_whose_step_steps_another_makes_one_step_with_its_result(
        tmp_path: Path, init: str) -> None:
    """Trial: DDP with ``ZeroRedundancyOptimizer``, "a replica's parameters drift from rank
    0's" at step 0 (exit 1) for ranks equal after every ``opt.step()``. The global step
    hooks fire for the inner optimizer too: the step ended when it returned, with only this
    rank's shard updated (ZeRO had not broadcast yet), and again at ZeRO's own end (two
    steps per update). A step is now the outermost optimizer's: its gradients from before
    it, its parameters from after it, as if one optimizer had done it all."""
    (tmp_path / "nested").mkdir()
    (tmp_path / "flat").mkdir()
    nested = capture(tmp_path / "nested", _nested(init))
    flat = capture(tmp_path / "flat", NESTED_STEPS.replace("OPTIMIZER", "Flat"))
    assert nested.n_steps == flat.n_steps == 3
    for field in ("params_fp", "grads_fp", "loss_fp"):
        assert _step_fields(nested, field) == _step_fields(flat, field), field


def test_a_wrapper_torch_never_hooks_still_makes_one_step_per_update(tmp_path: Path) -> None:
    # only the inner optimizer's step runs the hooks: the step ends when it returns
    assert capture(tmp_path, _nested(NEVER_HOOKED)).n_steps == 3


IN_BACKWARD = """
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizers = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def optimizer_hook(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    one = torch.optim.Adam(model.parameters(), foreach=False)  # the same update at once
    if HOOKED:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(optimizer_hook)
    for i in range(5):
        loss = model(torch.ones(3, 4) * (i + 1)).pow(2).mean()
        loss.backward()
        if not HOOKED:
            one.step()
            one.zero_grad()
    """


def test_optimizer_steps_inside_the_backward_make_one_step_per_backward(
        tmp_path: Path) -> None:
    """PyTorch's tutorial "fusing the optimizer step into the backward pass": one optimizer
    per parameter, stepped from ``register_post_accumulate_grad_hook`` as its gradient is
    ready. Each of those steps ended a training step (20 for 5 iterations of a model with
    4 parameters). A step now ends when the backward that ran them returns, with the
    parameters the same loop reaches with one Adam stepped after the backward."""
    (tmp_path / "hooked").mkdir()
    (tmp_path / "after").mkdir()
    hooked = capture(tmp_path / "hooked", IN_BACKWARD.replace("HOOKED", "True"))
    after = capture(tmp_path / "after", IN_BACKWARD.replace("HOOKED", "False"))
    assert hooked.n_steps == after.n_steps == 5
    for field in ("params_fp", "loss_fp"):
        assert _step_fields(hooked, field) == _step_fields(after, field), field


FAKE_DRY_RUN = """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    if DRY_RUN:  # a memory estimate: a whole training step on fake copies, nothing computed
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
            fake_opt = torch.optim.Adam(fake.parameters())
            fake(torch.empty(3, 4)).pow(2).mean().backward()
            fake_opt.step()
            model(torch.empty(3, 4))  # the real model, called on fake input
    for i in range(3):
        loss = model(torch.ones(3, 4) * (i + 1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    """


def test_a_dry_run_under_the_scripts_fake_tensors_is_not_training(tmp_path: Path) -> None:
    """Trial (faults round 13): a ``FakeTensorMode`` dry run before training (a model-size
    or memory estimate) was taken as training: its model call started the first step and
    nondet read state under the fake mode, exit 3 ("DataDependentOutputException"). Its
    calls, backward and optimizer step now pass; the real steps are those of the loop."""
    (tmp_path / "dry").mkdir()
    (tmp_path / "plain").mkdir()
    dry = capture(tmp_path / "dry", FAKE_DRY_RUN.replace("DRY_RUN", "True"))
    plain = capture(tmp_path / "plain", FAKE_DRY_RUN.replace("DRY_RUN", "False"))
    assert dry.n_steps == plain.n_steps == 3
    for field in ("params_fp", "grads_fp", "loss_fp"):
        assert _step_fields(dry, field) == _step_fields(plain, field), field



def _deterministic_run(tmp_path: Path, source: str) -> dict[str, Any]:
    """The JSON report of ``nondet run`` on ``source``, once it said "deterministic"."""
    import json
    import textwrap

    from tests.conftest import run_cli

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script), cwd=tmp_path,
                     timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report: dict[str, Any] = json.loads((tmp_path / "r.json").read_text())
    return report


OPTIMIZERS_MADE_IN_ANY_ORDER = """
    import random
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    params = list(model.parameters())
    optimizers = {}
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(3):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if not optimizers:  # made at the first update, as pyro makes them
            made = params[:]
            random.SystemRandom().shuffle(made)  # as pyro's set of tensors: another order
            optimizers = {p: torch.optim.Adam([p], lr=0.05) for p in made}
        for p in params:  # stepped in the model's order
            optimizers[p].step()
            p.grad = None
    print(float(sum(p.detach().sum() for p in model.parameters())))
"""


def test_optimizer_state_is_named_in_parameter_order_whatever_order_optimizers_were_made(
        tmp_path: Path) -> None:
    """Trial round 18: pyro makes one optimizer per parameter as it first steps it, in the
    order of a set of tensors (their addresses), so the optimizers' order differed between
    the runs and so did the optimizer state's fingerprint, values the same (a false alarm)."""
    report = _deterministic_run(tmp_path, OPTIMIZERS_MADE_IN_ANY_ORDER)
    assert report["verdict"] == "deterministic"


LOOSE_PARAMETERS_IN_ANY_ORDER = """
    import random
    import torch
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(4) * (i + 1)) for i in range(4)]  # no module
    rest = ws[2:]
    random.SystemRandom().shuffle(rest)  # as list(set(ws)): memory addresses' order
    # one optimizer each, made before the first forward: the first made starts training
    per_parameter = {w: torch.optim.SGD([w], lr=0.05) for w in rest}
    opt = None
    for step in range(4):
        loss = sum((w ** 2).sum() * (i + 1) for i, w in enumerate(ws))
        loss.backward()
        if opt is None:  # made at the first update, given a set's order
            first = ws[:2]
            random.SystemRandom().shuffle(first)
            opt = torch.optim.Adam(first, lr=0.1)
        for o in per_parameter.values():
            o.step()
        opt.step()
        for w in ws:
            w.grad = None
    print(float(sum(w.detach().sum() for w in ws)))
"""


def test_parameters_no_module_owns_are_named_after_their_list_in_any_optimizer_order(
        tmp_path: Path) -> None:
    """Parameters no module owns were named by optimizer slot and folded in slot order: an
    optimizer given them in a set's order (memory addresses), or one optimizer each made
    in such an order, made a deterministic script nondeterministic (``aten.zeros_like`` at
    the first Adam step). They are now ``ws[0]``..., folded by owner in its order; the
    first optimizer made lists its owner's every parameter at init; an optimizer made after
    the backward joins its update (the first update was three steps)."""
    report = _deterministic_run(tmp_path, LOOSE_PARAMETERS_IN_ANY_ORDER)
    assert [r["steps"] for r in report["runs"]] == [4, 4]


PER_PARAMETER_OPTIMIZERS = """
    import random
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    class ClippedAdam(torch.optim.Adam):
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.clamp_(-0.01, 0.01)  # in place, as pyro's ClippedAdam does
            return super().step(closure)

    optimizers = {}
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(4):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        params = list(model.parameters())
        random.SystemRandom().shuffle(params)  # as pyro's set of tensors: another order
        for p in params:
            if p not in optimizers:  # made just before it first steps, as pyro does
                optimizers[p] = ClippedAdam([p], lr=0.05)
            optimizers[p].step()
            p.grad = None
    print(float(sum(p.detach().sum() for p in model.parameters())))
"""


def test_optimizers_stepped_one_after_another_in_any_order_are_one_step(
        tmp_path: Path) -> None:
    """Trial round 18: pyro steps one optimizer per parameter, in an order that differs
    between runs; each optimizer step ended a step, so the runs were compared halfway
    through the update (another parameter updated in each) and a deterministic script was
    called nondeterministic, with 4 steps per iteration (Note [Optimizer groups])."""
    report = _deterministic_run(tmp_path, PER_PARAMETER_OPTIMIZERS)
    assert [r["steps"] for r in report["runs"]] == [4, 4]  # iterations, not optimizer steps
