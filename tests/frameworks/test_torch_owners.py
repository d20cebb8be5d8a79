"""Parameters an optimizer is given before their model was called (owners.py, state.py):
named after the module variable that owns them and listed in its order, so an optimizer
given them in another order (``set(model.parameters())`` iterates by memory address, which
differs from run to run) has the same step state. Before, the init row and the optimizer
state followed the slot order: a deterministic script was reported nondeterministic."""

from __future__ import annotations

import sys
import weakref

import pytest

torch = pytest.importorskip("torch")

from nondet.frameworks.torch import owners  # noqa: E402
from nondet.frameworks.torch.state import named_state  # noqa: E402


def _state_in_slot_order(model: torch.nn.Module, order: list[int]
                         ) -> tuple[list[str], list[str], list[int]]:
    """Names of the parameters and of the optimizer state, and the parameters' identities,
    for an optimizer given the model's parameters in ``order`` (made here, one frame below
    the caller whose local ``model`` owns them)."""
    params = list(model.parameters())
    opt = torch.optim.SGD([params[i] for i in order], lr=0.1, momentum=0.9)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()  # a momentum buffer per parameter
    found = owners.owner_names((p for g in opt.param_groups for p in g["params"]), {},
                               sys._getframe(1))
    named, _, optim = named_state([], [weakref.ref(opt)], {}, found)
    return [n for n, _ in named], [n for n, _ in optim], [id(t) for _, t in named]


def test_an_optimizer_given_parameters_in_another_order_has_the_same_state_order() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    listed = _state_in_slot_order(model, [0, 1, 2, 3])
    shuffled = _state_in_slot_order(model, [3, 1, 0, 2])
    assert listed == shuffled
    names, optim, _ = listed
    assert names == ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
    assert optim == [f"{n}:momentum_buffer" for n in names]


def test_parameters_no_variable_holds_keep_their_slot_names() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    found = owners.owner_names(opt.param_groups[0]["params"], {}, sys._getframe())
    named, _, _ = named_state([], [weakref.ref(opt)], {}, found)
    assert [n for n, _ in named] == ["optimizer0.group0.param0"]


def test_loose_parameters_are_named_after_their_container_then_their_variable() -> None:
    ws = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    table = {"bias": torch.nn.Parameter(torch.zeros(2))}
    w = ws[1]  # a variable of its own too: the list's name wins (a loop's would name all)
    scale = torch.nn.Parameter(torch.ones(1))
    opts = [torch.optim.SGD([p], lr=0.1) for p in (scale, table["bias"], ws[2], w, ws[0])]
    found: dict[int, str] = {}
    for opt in opts:  # one call per optimizer, as the backend makes them
        found.update(owners.owner_names(opt.param_groups[0]["params"], {}, sys._getframe()))
    named, _, _ = named_state([], [weakref.ref(o) for o in opts], {}, found)
    # in the order of their names, not of the optimizers
    assert [n for n, _ in named] == ["scale", "table['bias']", "ws[0]", "ws[1]", "ws[2]"]


def test_a_lazy_modules_parameters_join_the_state_once_materialized() -> None:
    """torchrl's MLP without in_features is LazyLinears: at the init row (its first call)
    the parameters are UninitializedParameters, whose every read raises; hashing one was
    nondet's internal error (exit 3) in every such script."""
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    before, _, _ = named_state([model], [], {})
    assert [tuple(t.shape) for _, t in before] == [(2, 4), (2,)]
    model(torch.ones(1, 3))
    after, _, _ = named_state([model], [], {})
    assert [tuple(t.shape) for _, t in after] == [(4, 3), (4,), (2, 4), (2,)]


def test_a_list_in_a_sets_order_is_told_from_one_put_in_order() -> None:
    """``list(set(model.parameters()))``: no set reaches the optimizer, but the list's order
    is the set's (memory addresses). Its group is set-ordered; the module's own order and a
    deliberate order a set would not give are not (round 7)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])
    params = list(model.parameters())
    order = {id(p): i for i, p in enumerate(params)}

    def ids(ps: list[torch.Tensor]) -> list[int]:
        return [id(p) for p in ps]

    as_set = list(set(params))
    assert ids(as_set) != ids(params)  # 10 tensors: a set's order is not the module's
    assert owners.set_ordered([as_set], order)
    assert not owners.set_ordered([params], order)
    reordered = params[::-1]  # a deliberate order
    assert ids(as_set) != ids(reordered)
    assert not owners.set_ordered([reordered], order)
    assert owners.set_ordered([params[:2], as_set], order)  # any group


class _Proxy:
    """A lazy proxy whose every attribute lookup fails (as one not yet resolved may)."""

    def __getattribute__(self, name: str) -> object:
        raise RuntimeError(f"not resolved: {name}")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing")

    __hash__ = None  # type: ignore[assignment]


def test_the_frame_walk_never_runs_the_users_objects() -> None:
    """The walk over the optimizer's callers' variables meets anything: a proxy whose
    ``__class__`` raises, objects that refuse ``==`` and hashing, a large dict. It must
    neither raise nor call them (a hook raising into the script is the worst bug)."""
    proxy = _Proxy()
    table = {i: str(i) for i in range(100_000)}
    model = torch.nn.Linear(3, 2)
    found = owners.owner_names(list(model.parameters()), {}, sys._getframe())
    assert sorted(found.values()) == ["model.bias", "model.weight"]
    assert proxy is not None and len(table) == 100_000
