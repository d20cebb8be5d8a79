"""torch.optim's update kernels recorded as one op per call (Note [Optimizer kernels as one
record] in torch/kernels.py): the same training, fewer records, the injection rule as
exact as the pointwise ops it replaces."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("torch")

import importlib

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nondet import compare
from nondet.frameworks.torch import kernels
from nondet.frameworks.torch.kernels import KernelCalls
from nondet.frameworks.torch.ops import OpRecorder
from nondet.frameworks.torch.testing import KernelHost, RecordMode, recorder
from nondet.records import Kind

# torch.optim deletes its submodules' names from itself: reached through the import system
ADAM_MODULE = importlib.import_module("torch.optim.adam")
SGD_MODULE = importlib.import_module("torch.optim.sgd")
ADAM = "torch.optim.adam._single_tensor_adam"
SGD = "torch.optim.sgd._single_tensor_sgd"


@contextmanager
def kernels_recorded(monkeypatch: pytest.MonkeyPatch
                     ) -> Iterator[tuple[OpRecorder, KernelHost, RecordMode]]:
    """A recorder with its window open, the Adam and SGD kernels wrapped as the backend
    wraps them, and the recorder's mode (not pushed: the caller pushes it per step)."""
    rec = recorder()
    rec.open_window()
    mode = RecordMode(rec)
    host = KernelHost(rec, mode)
    calls = KernelCalls(host)  # type: ignore[arg-type]  # a partial host
    for module, name in ((ADAM_MODULE, "_single_tensor_adam"),
                         (SGD_MODULE, "_single_tensor_sgd")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, calls.wrap(original, f"{module.__name__}.{name}"))
    yield rec, host, mode


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
           mode: TorchDispatchMode | None) -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6) / (10 + step)

    def run() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    if mode is None:
        run()
    else:
        with mode:
            run()


def _names(rec: OpRecorder, rows: np.ndarray) -> list[str]:
    """The records' names, without the profiler ranges (CaptureMode passes those)."""
    strings = rec.session.strings
    return [name for name in (strings[int(r["name"])] for r in rows)
            if not name.startswith("profiler.")]


OPTIMIZERS: list[tuple[str, Callable[[Any], torch.optim.Optimizer]]] = [
    (ADAM, lambda p: torch.optim.Adam(p, lr=0.01)),
    (ADAM, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True)),
    (ADAM, lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, maximize=True)),
    (SGD, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True,
                                    weight_decay=0.01)),
    (SGD, lambda p: torch.optim.SGD(p, lr=0.01)),
]


@pytest.mark.parametrize(("kernel", "make"), OPTIMIZERS)
def test_a_kernel_is_one_record_after_its_first_call_and_trains_the_same(
        monkeypatch: pytest.MonkeyPatch, kernel: str,
        make: Callable[[Any], torch.optim.Optimizer]) -> None:
    """The first call on a path is recorded op by op (and checked); the later ones are one
    record named after the kernel; the parameters are those of training without nondet."""
    plain = _model()
    plain_opt = make(plain.parameters())
    for step in range(5):
        _train(plain, plain_opt, step, None)
    with kernels_recorded(monkeypatch) as (rec, _, mode):
        model = _model()
        optimizer = make(model.parameters())
        per_step = []
        for step in range(5):
            _train(model, optimizer, step, mode)
            rec.resolve()
            per_step.append(_names(rec, rec.take_rows(step)))
    assert kernel not in per_step[0]  # the first call: op by op, and checked
    for names in per_step[2:]:  # (SGD's momentum buffers: None at the first call)
        assert names.count(kernel) == 1
        after = names[names.index(kernel):]
        assert after == [kernel], f"ops recorded after the kernel: {after}"
    assert len(per_step[4]) < len(per_step[0])
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def _two_runs(monkeypatch: pytest.MonkeyPatch,
              change: tuple[Callable[[torch.optim.Optimizer], None], ...]
              ) -> tuple[np.ndarray, np.ndarray, list[str], list[int]]:
    """Step 3's records of two identical Adam trainings, ``change[run]`` applied to each
    one's optimizer right before its step 3 (after the backward: the same ops, other
    values), and how many of each parameter's tensors (the parameter, its gradient and its
    state) differ in fingerprint between the runs after it. Each run's
    fingerprints of every parameter, gradient and moment after it (per parameter)."""
    rows, after = [], []
    for run in range(2):
        with kernels_recorded(monkeypatch) as (rec, _, mode):
            model = _model()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            for step in range(3):
                _train(model, optimizer, step, mode)
                rec.resolve()
                rec.take_rows(step)
            x = torch.ones(4, 6)
            with mode:
                optimizer.zero_grad()
                model(x).sum().backward()
                change[run](optimizer)
                optimizer.step()
            rec.resolve()
            rows.append(rec.take_rows(3))
            strings = rec.session.strings
            after.append([[rec.known(t).value  # type: ignore[union-attr]
                           for t in (p, p.grad, *optimizer.state[p].values())]
                          for p in model.parameters()])
        monkeypatch.undo()
    return rows[0], rows[1], strings, [sum(a != b for a, b in zip(x, y, strict=True))
                                       for x, y in zip(*after, strict=True)]


def _scale(factor: float) -> Callable[[torch.optim.Optimizer], None]:
    def scale(optimizer: torch.optim.Optimizer) -> None:
        grad = optimizer.param_groups[0]["params"][2].grad
        grad.mul_(factor)  # recorded: the op that makes the difference (in run b)

    return scale


def test_a_differing_gradient_is_an_input_of_the_kernel_not_its_difference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient that differs (made by an op before the kernel) makes the kernel's inputs
    differ, so the finding is that op, never the kernel."""
    a, b, strings, _ = _two_runs(monkeypatch, (_scale(1.0), _scale(1.5)))
    found = compare.first_op_divergence(a, b, strings, strings)
    assert found is not None
    assert strings[int(found.row_a["name"])].startswith("aten.mul_")
    (at,) = [i for i, r in enumerate(a) if strings[int(r["name"])] == ADAM]
    assert int(a[at]["in_fp"]) != int(b[at]["in_fp"])
    assert int(a[at]["scalar_fp"]) == int(b[at]["scalar_fp"])


def test_outputs_are_derived_per_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameter i's outputs depend on the i-th element of each list alone: a gradient
    changed for parameter 2 changes the fingerprints of parameter 2, its gradient and its
    moments after the kernel, and no other tensor's."""
    _, _, _, differing = _two_runs(monkeypatch, (_scale(1.0), _scale(1.5)))
    assert differing[2] == 5  # the parameter, its gradient, step, exp_avg, exp_avg_sq
    assert [n for i, n in enumerate(differing) if i != 2] == [0, 0, 0]


def test_a_differing_learning_rate_is_named_at_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python number that differs (the learning rate) with every input the same: the
    kernel's record is the finding, as a scalar argument (an entry), as the first of
    Adam's ops with it was before."""

    def rate(lr: float) -> Callable[[torch.optim.Optimizer], None]:
        def set_rate(optimizer: torch.optim.Optimizer) -> None:
            optimizer.param_groups[0]["lr"] = lr

        return set_rate

    a, b, strings, _ = _two_runs(monkeypatch, (rate(0.01), rate(0.005)))
    found = compare.first_op_divergence(a, b, strings, strings)
    assert found is not None and found.kind == "entry" and found.scalar_argument
    assert strings[int(found.row_a["name"])] == ADAM


def test_a_state_tensor_never_seen_is_an_entry_of_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A moment replaced outside the recorded ops (a new tensor: ``load_state_dict``) is
    read by the kernel as an entry point, recorded as such before the kernel's record."""
    with kernels_recorded(monkeypatch) as (rec, _, mode):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(3):
            _train(model, optimizer, step, mode)
            rec.resolve()
            rec.take_rows(step)
        first = next(iter(model.parameters()))
        rec.active = False
        optimizer.state[first]["exp_avg"] = torch.full_like(first, 0.5)  # unrecorded
        rec.active = True
        _train(model, optimizer, 3, mode)
        rec.resolve()
        rows = rec.take_rows(3)
    strings = rec.session.strings
    records = [(strings[int(r["name"])], int(r["kind"])) for r in rows]
    at = records.index((ADAM, int(Kind.OP)))
    assert ("external:tensor float32[5, 6]", int(Kind.ENTRY)) in records[:at], records


def _pointwise_kernel(params: list[torch.Tensor], grads: list[torch.Tensor], *,
                      lr: float) -> None:
    for p, g in zip(params, grads, strict=True):
        p.add_(g, alpha=-lr)


def _hashing_kernel(params: list[torch.Tensor], grads: list[torch.Tensor], *,
                    lr: float) -> None:
    for p, g in zip(params, grads, strict=True):
        p.add_(g * g.sum(), alpha=-lr)  # a reduction: hashed, never derived


@pytest.mark.parametrize(("kernel", "whole"), [(_pointwise_kernel, True),
                                               (_hashing_kernel, False)])
def test_a_path_is_recorded_whole_only_if_its_first_call_derived_every_output(
        kernel: Callable[..., None], whole: bool) -> None:
    rec = recorder()
    rec.open_window()
    mode = RecordMode(rec)
    calls = KernelCalls(KernelHost(rec, mode))  # type: ignore[arg-type]
    wrapped = calls.wrap(kernel, "test.kernel")
    params = [torch.ones(3), torch.ones(2)]
    with mode, torch.no_grad():
        grads = [torch.full((3,), 0.5), torch.full((2,), 0.25)]
        counts = []
        for _ in range(3):
            before = len(rec.records)
            wrapped(params, grads, lr=0.1)
            counts.append(len(rec.records) - before)
    assert (counts[1:] == [1, 1]) is whole, counts
    assert counts[0] > 1


def test_with_another_mode_pushed_the_kernel_is_recorded_op_by_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder's mode is taken off only when it is the only one: a mode the script
    pushed (above or below it) keeps seeing the kernel's ops."""

    class Counting(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.seen = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.seen += 1
            return func(*args, **(kwargs or {}))

    with kernels_recorded(monkeypatch) as (rec, _, mode):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(3):
            _train(model, optimizer, step, mode)
            rec.resolve()
            rec.take_rows(step)
        counting = Counting()
        with counting:
            _train(model, optimizer, 3, mode)
        rec.resolve()
        names = _names(rec, rec.take_rows(3))
    assert ADAM not in names
    assert names.count("aten.addcdiv_.default") == 4
    assert counting.seen > 4 * 8


def test_nondet_failing_around_the_kernel_runs_it_once_and_reports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of nondet's own after the kernel ran: reported (hook_failed), the update
    applied exactly once; before it ran: reported, the kernel run as without nondet."""
    for where in ("before", "after"):
        plain = _model()
        plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
        for step in range(4):
            _train(plain, plain_opt, step, None)
        with kernels_recorded(monkeypatch) as (_rec, host, mode):
            model = _model()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            for step in range(3):
                _train(model, optimizer, step, mode)

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("nondet's own bug")

            if where == "before":
                monkeypatch.setattr(KernelCalls, "_path", broken)
            else:
                monkeypatch.setattr(kernels, "_out_meta", broken)
            _train(model, optimizer, 3, mode)
        monkeypatch.undo()
        assert host.failures == 1, where
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), where


def test_the_kernels_own_error_reaches_the_script_unchanged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with kernels_recorded(monkeypatch) as (_rec, host, mode):
        params = [torch.ones(3)]
        with mode, torch.no_grad():
            wrapped = SGD_MODULE._single_tensor_sgd
            for _ in range(2):
                wrapped(params, [torch.ones(3)], [None], None, None, weight_decay=0.0,
                        momentum=0.0, lr=0.1, dampening=0.0, nesterov=False, maximize=False,
                        has_sparse_grad=False)
            with pytest.raises(RuntimeError, match="size of tensor"):
                wrapped(params, [torch.ones(4)], [None], None, None, weight_decay=0.0,
                        momentum=0.0, lr=0.1, dampening=0.0, nesterov=False,
                        maximize=False, has_sparse_grad=False)
    assert host.failures == 0
