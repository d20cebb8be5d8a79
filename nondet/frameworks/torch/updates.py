"""Which optimizer step ends a training step, when one update takes several optimizers.

Note [Optimizer groups]
Pyro keeps one optimizer per parameter and steps them one after another, in the order of
a set of tensors, which follows their addresses: another order in each run. A training
step that ended at every optimizer step compared the runs halfway through the update (one
parameter updated in one run, another in the other): a false alarm on a deterministic
script (trial round 18), and 4 "steps" per iteration. So an optimizer step that leaves
gradients the latest backward wrote to parameters no optimizer has stepped since does not
end the step; the step ends at the optimizer step that leaves none, or, as a hand-written
update does, at the next forward, backward or batch. Only parameters some optimizer holds
count (a parameter the script never steps, though it has a gradient, holds no step open),
except while optimizers are still being made after that backward: pyro makes each one
just before it first steps it. The parameters of an optimizer made after the backward
began count too when they have a gradient: no module owns them (they were not listed when
the backward began), and one optimizer each made at the first update otherwise split that
update into a step per optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_Key = tuple[int, int] | None


def _grad_key(p: torch.Tensor) -> _Key:
    """What tells a gradient the backward wrote: a new tensor, or the old one written."""
    grad = p.grad
    return None if grad is None else (id(grad), grad._version)


class FreshGrads:
    """Gradients of the latest backward, and the parameters optimizers stepped since."""

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []
        self._keys: dict[int, _Key] = {}
        self._stepped: set[int] = set()
        self._made = 0  # optimizers made when the latest backward began

    def backward_began(self, params: Iterable[torch.Tensor], made: int) -> None:
        """The script's own backward is about to run over ``params`` (``made``: how many
        optimizers the script has made so far)."""
        self._params = list(params)
        self._keys = {id(p): _grad_key(p) for p in self._params}
        self._stepped = set()
        self._made = made

    def others_left(self, optimizer: torch.optim.Optimizer,
                    optimizers: Iterable[torch.optim.Optimizer], made: int) -> bool:
        """``optimizer`` stepped: does a gradient of the latest backward still wait for
        another optimizer (Note [Optimizer groups])?"""
        stepped = self._stepped
        stepped.update(id(p) for group in optimizer.param_groups for p in group["params"])
        waiting = [p for p in self._params
                   if id(p) not in stepped and _grad_key(p) != self._keys.get(id(p))]
        if made > self._made:  # optimizers are still being made: any parameter counts,
            # those of an optimizer made since the backward too (no module owns them, so the
            # backward's start did not list them): one with a gradient is waiting
            return bool(waiting) or any(
                p.grad is not None for opt in list(optimizers)[self._made:]
                for group in opt.param_groups for p in group["params"]
                if id(p) not in stepped and id(p) not in self._keys)
        if not waiting:
            return False
        held = {id(p) for opt in optimizers for group in opt.param_groups
                for p in group["params"]}
        return any(id(p) in held for p in waiting)
