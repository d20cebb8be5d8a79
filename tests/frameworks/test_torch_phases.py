"""Phases in loops that are not one forward, one backward, one update per step."""

from __future__ import annotations

from pathlib import Path

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
