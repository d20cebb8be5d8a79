"""The meta device under nondet.

nondet's wrappers of torch.tensor/as_tensor/from_numpy keep `with torch.device(...)` and
`torch.set_default_device` working (found by a sentence-transformers trial: Hugging Face
`from_pretrained` builds models under `torch.device("meta")`, and under nondet it left the
non-persistent buffers, BERT's `position_ids`, uninitialized: "index 734439407782 is out of
bounds" in run a, or garbage values). Parameters on the meta device are no training state."""

from __future__ import annotations

import textwrap
from pathlib import Path

from nondet.launch import CapturedRun, Plan, Target
from nondet.store import open_capture
from tests.frameworks.test_torch_capture import capture


def test_tensors_made_from_data_follow_the_device_context(tmp_path: Path) -> None:
    c = capture(tmp_path, """
        import numpy as np, torch
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.device("meta"):
            made = [torch.tensor([1.0]), torch.as_tensor([1.0]), torch.zeros(1)]
            default = torch.get_default_device()
        devices = [t.device.type for t in made] + [default.type]
        if devices != ["meta"] * 4:
            raise SystemExit(f"devices {devices}")
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        """)
    assert c.n_steps == 1


def test_a_model_template_on_the_meta_device_is_not_training_state(tmp_path: Path) -> None:
    """torch.func ensembling (the tutorial's ``stack_module_state`` + ``functional_call``
    on a copy moved to "meta"): the template is called like a model, so it became a root,
    and its meta parameters went into the step state: "nondet's hooks failed: Tensor on
    device cpu is not on the expected device meta!" (exit 3)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import copy, torch
        from torch.func import functional_call, stack_module_state, vmap
        torch.manual_seed(0)
        models = [torch.nn.Linear(4, 2) for _ in range(3)]
        params, buffers = stack_module_state(models)
        params = {k: torch.nn.Parameter(v) for k, v in params.items()}
        base = copy.deepcopy(models[0]).to("meta")
        opt = torch.optim.SGD(params.values(), lr=0.1)
        for step in range(2):
            out = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)),
                       in_dims=(0, 0, None))(params, buffers, torch.ones(5, 4))
            opt.zero_grad(); out.pow(2).mean().backward(); opt.step()
        """))
    run = CapturedRun(Target(str(script), None, ()), Plan("t", [0]), 0, tmp_path / "out")
    run.start()
    result = run.wait()
    assert result.status == "complete" and not result.hook_error, result.hook_error
    c = open_capture(result.path)
    assert c.n_steps == 2 and len(c.ops(0)) > 0
