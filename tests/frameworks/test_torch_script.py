"""TorchScript under nondet: scripted code that calls a torch function nondet wraps."""

from __future__ import annotations

from pathlib import Path

from tests.frameworks.test_torch_capture import capture


def test_scripted_code_calling_torch_tensor_compiles(tmp_path: Path) -> None:
    """Found by a pytorch-ignite trial: ``import torch.distributed.optim`` scripts classes
    that call ``torch.tensor``; under nondet TorchScript took the wrapper for Python source
    ("TypeError: module, class, method, function, ... was expected"), and the user's script
    failed (exit 2, blamed on the script)."""
    c = capture(tmp_path, """
        import torch
        import torch.distributed.optim  # noqa: F401

        @torch.jit.script
        def shifted(x: torch.Tensor) -> torch.Tensor:
            return x + torch.tensor(1.0)

        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        shifted(model(torch.ones(3, 2))).sum().backward()
        opt.step()
        """)
    assert c.n_steps == 1
