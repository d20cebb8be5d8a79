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
them by owner, in the owner's order, whatever the order the optimizers were made in (pyro
makes one per parameter, in a set's order); parameters no module owns are named after the
variable, list, tuple or dict that holds them (``ws[2]``). Optimizer state follows the
parameters' order (state.py).
The optimizer given a set, or groups listed in another order than their modules', is a fact
with its line: an order-sensitive sum over the list (``clip_grad_norm_``, a foreach or
fused update) then gets PY-TENSOR-SET-ORDER first (the set's order is its cause).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import cast

import torch

#: Frames searched outward from the optimizer's constructor call (the script's own frames
#: and a library's few between them: Trainer.create_optimizer, Lightning's configure step).
_DEPTH = 8


def owner_names(params: Iterable[torch.Tensor], named: dict[int, str],
                frame: FrameType | None,
                held: dict[int, weakref.ref[torch.Tensor]] | None = None) -> dict[int, str]:
    """``id(parameter) -> "model.0.weight"`` for the parameters not in ``named``, found in
    the nn.Module variables of ``frame`` and the frames that called it; in each module's
    own parameter order (dicts keep it). ``held`` gets every trainable tensor of the owners
    found, which the state lists from then on (``state.named_state``)."""
    wanted = {id(p) for p in params if id(p) not in named}
    found: dict[int, str] = {}
    seen: set[int] = set()  # modules already listed (one module, many variables)
    depth = 0
    first = frame
    while frame is not None and wanted and depth < _DEPTH:
        for var, value in _locals(frame):
            # type(), not isinstance(): a proxy's __class__ may raise or lie; only real
            # modules own parameters. Only ids are compared: no user __eq__/__hash__ runs.
            if not issubclass(type(value), torch.nn.Module) or id(value) in seen:
                continue
            seen.add(id(value))
            try:
                members = list(cast(torch.nn.Module, value).named_parameters())
            except Exception:  # a module whose parameters cannot be listed yet: not an owner
                continue
            _name_all(found, named, wanted, [(f"{var}.{path}", p) for path, p in members],
                      held)
        frame, depth = frame.f_back, depth + 1
    # then parameters no module owns, in a list, tuple or dict (``ws[2]``), else in a
    # variable of their own: optimizers made one per parameter in a set's order were named
    # by optimizer slot, a false alarm (Note [Parameters an optimizer is given in another
    # order]). A module's name comes first, then a container's: a loop's variable (``w``
    # of ``for w in set(ws)``) names every parameter alike
    for containers in (True, False):
        frame, depth = first, 0
        while frame is not None and wanted and depth < _DEPTH:
            variables = _locals(frame)
            # not an optimizer's own frames: their ``params`` is the list in slot order
            if not any(var == "self" and issubclass(type(value), torch.optim.Optimizer)
                       for var, value in variables):
                for var, value in variables:
                    _name_all(found, named, wanted, _held_tensors(var, value, containers),
                              held)
            frame, depth = frame.f_back, depth + 1
    return found


def _name_all(found: dict[int, str], named: dict[int, str], wanted: set[int],
              members: list[tuple[str, torch.Tensor]],
              held: dict[int, weakref.ref[torch.Tensor]] | None) -> None:
    """An owner of a wanted parameter names all its parameters at once, in its own order:
    the order ``state._add_loose`` folds an owner's parameters in, whichever optimizer
    (made in whatever order) holds them. Its trainable ones go to ``held``: one optimizer
    per parameter made in a set's order before the first forward started training with
    another parameter in each run's init row."""
    if not any(id(p) in wanted for _, p in members):
        return
    for path, p in members:
        if id(p) not in named and id(p) not in found:
            found[id(p)] = path
            if held is not None and p.requires_grad:
                held[id(p)] = weakref.ref(p)
        wanted.discard(id(p))


#: Items of a container variable looked at for loose parameters (a dataset's list of
#: tensors is no place for them, and must cost nothing).
_MAX_ITEMS = 256


def _held_tensors(var: str, value: object, containers: bool) -> list[tuple[str, torch.Tensor]]:
    """The tensors in a variable's list, tuple or dict (exact built-in types: no user code
    runs), or with ``containers`` False the variable's own tensor, with their paths."""
    kind = type(value)
    if not containers:
        return [(var, cast(torch.Tensor, value))] if issubclass(kind, torch.Tensor) else []
    if kind is list or kind is tuple:
        items = cast(Sequence[object], value)
        if len(items) > _MAX_ITEMS:
            return []
        return [(f"{var}[{i}]", cast(torch.Tensor, t)) for i, t in enumerate(items)
                if issubclass(type(t), torch.Tensor)]
    if kind is dict:
        entries = cast(dict[object, object], value)
        if len(entries) > _MAX_ITEMS:
            return []
        return [(f"{var}[{k!r}]", cast(torch.Tensor, t)) for k, t in list(entries.items())
                if type(k) is str and issubclass(type(t), torch.Tensor)]
    return []


def _locals(frame: FrameType) -> list[tuple[str, object]]:
    """A frame's variables (a module frame's are its globals: a script's may be many; a
    dict read in C, no user code runs), or none when they cannot be read."""
    try:
        return list(frame.f_locals.items())
    except Exception:
        return []


def set_ordered(groups: Iterable[Sequence[torch.Tensor]], order: dict[int, int]) -> bool:
    """Some parameter group lists its parameters in a set's order, not in the order of the
    modules that own them (``order``: id -> position in module order), as
    ``list(set(model.parameters()))`` does: a set of tensors iterates by their memory
    addresses, so the order differs between runs. A list put in another order on purpose
    (a head's parameters first) is not: it iterates otherwise than a set of it would."""
    for group in groups:
        known = [p for p in group if id(p) in order]
        seq = [order[id(p)] for p in known]
        if len(seq) < 2 or all(a < b for a, b in itertools.pairwise(seq)):
            continue
        try:  # a set made from them in module order (as set(model.parameters()) was made)
            as_set = set(sorted(known, key=lambda p: order[id(p)]))
        except Exception:  # a tensor subclass whose __hash__ refuses: no set was made of it
            continue
        if [id(p) for p in as_set] == [id(p) for p in known]:
            return True
    return False


def given_a_set(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """The optimizer's ``params`` argument is a set (torch turns it into a list; it refuses
    a set only inside a parameter-group dict)."""
    params = args[0] if args else kwargs.get("params")
    return isinstance(params, (set, frozenset))
