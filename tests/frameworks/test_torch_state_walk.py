"""The step state's module walk gives what ``Module.parameters()``/``buffers()`` give, in
the same order (Note [Walking the modules] in torch/state.py)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

from nondet.frameworks.torch.state import _walk, named_params, named_state


def _trees() -> list[nn.Module]:
    shared = nn.Linear(4, 4)
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    tied[1].weight = tied[0].weight  # one parameter in two modules
    deep = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),
        nn.ModuleDict({"b": nn.LSTM(4, 4), "a": shared}),
        nn.Sequential(shared, nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 2))),
    )
    deep.extra = nn.Parameter(torch.ones(1))  # the root's own, after its children
    deep.register_buffer("count", torch.zeros(1))
    deep[0].register_parameter("unused", None)
    deep[1].register_buffer("nothing", None)
    parametrize.register_parametrization(deep[0], "weight", nn.Identity())
    return [deep, tied, nn.Linear(2, 2), nn.ReLU()]


@pytest.mark.parametrize("tree", _trees())
def test_the_walk_is_torchs_walk(tree: nn.Module) -> None:
    walked = _walk(tree, with_buffers=True)
    assert walked is not None
    params, buffers = walked
    assert [id(p) for p in params] == [id(p) for p in tree.parameters()]
    assert [id(b) for b in buffers] == [id(b) for b in tree.buffers()]


class _Frozen(nn.Module):
    """Walks itself otherwise: only its trainable parameters are its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.b.requires_grad_(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for p in super().parameters(recurse) if p.requires_grad)


def test_a_module_that_walks_itself_otherwise_is_walked_by_torch() -> None:
    root = nn.Sequential(_Frozen())
    assert _walk(root, with_buffers=True) is None
    params, _, _ = named_state([root], [], {})
    assert [id(p) for _, p in params] == [id(p) for p in root.parameters()]


def test_the_gradient_snapshot_names_the_step_states_parameters() -> None:
    root = _trees()[0]
    loose = nn.Parameter(torch.ones(3))  # an optimizer's parameter no root owns
    optimizer = torch.optim.SGD([*root.parameters(), loose], lr=0.1)
    names = {id(p): n for n, p in root.named_parameters()}
    refs = [weakref.ref(optimizer)]
    params, _, _ = named_state([root], refs, names)
    assert named_params([root], refs, names) == params
    assert params[-1][1] is loose
