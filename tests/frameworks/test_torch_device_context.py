"""nondet's wrappers of torch.tensor/as_tensor/from_numpy keep `with torch.device(...)` and
`torch.set_default_device` working (found by a sentence-transformers trial: Hugging Face
`from_pretrained` builds models under `torch.device("meta")`, and under nondet it left the
non-persistent buffers, BERT's `position_ids`, uninitialized: "index 734439407782 is out of
bounds" in run a, or garbage values)."""

from __future__ import annotations

from pathlib import Path

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
