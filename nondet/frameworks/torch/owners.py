"""Names for parameters an optimizer is given before any model owning them was called.

Note [Parameters an optimizer is given in another order]
An optimizer made before the first forward (the usual order) sends the init row before any
root module is known, so its parameters could only be named by their optimizer slot, in slot
order. That order is the script's container order: ``set(model.parameters())`` (or
``list(set(...))``, a set difference of parameter groups) iterates in memory-address order,
which differs from run to run while every value repeats. The init row then "differed" in a
deterministic script (a false alarm), and optimizer state, kept in slot order, differed at
every step. Here the parameters are named after the module that owns them, found among the
variables of the frames that made the optimizer (``model.0.weight``), so the init row lists
them in that module's order; optimizer state follows the parameters' order (state.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import FrameType

import torch

#: Frames searched outward from the optimizer's constructor call (the script's own frames
#: and a library's few between them: Trainer.create_optimizer, Lightning's configure step).
_DEPTH = 8


def owner_names(params: Iterable[torch.Tensor], named: dict[int, str],
                frame: FrameType | None) -> dict[int, str]:
    """``id(parameter) -> "model.0.weight"`` for the parameters not in ``named``, found in
    the nn.Module variables of ``frame`` and the frames that called it; in each module's
    own parameter order (dicts keep it)."""
    wanted = {id(p) for p in params if id(p) not in named}
    found: dict[int, str] = {}
    depth = 0
    while frame is not None and wanted and depth < _DEPTH:
        for var, value in list(frame.f_locals.items()):
            if not isinstance(value, torch.nn.Module):
                continue
            try:
                members = list(value.named_parameters())
            except Exception:  # a module whose parameters cannot be listed yet: not an owner
                continue
            for path, p in members:
                if id(p) in wanted:
                    wanted.discard(id(p))
                    found[id(p)] = f"{var}.{path}"
        frame, depth = frame.f_back, depth + 1
    return found


def given_a_set(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """The optimizer's ``params`` argument is a set (torch turns it into a list; it refuses
    a set only inside a parameter-group dict)."""
    params = args[0] if args else kwargs.get("params")
    return isinstance(params, (set, frozenset))
