"""Float statistics of step-level state on the host (hoststats.py): the same numbers as
torch's reductions (max |x| exactly, sums to float64 rounding), and a CPU step end that
runs no torch reduction (each one enters torch's OpenMP pool)."""

from __future__ import annotations

import math
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from nondet.frameworks.torch.state import named_state  # noqa: E402
from nondet.frameworks.torch.stepstate import GroupFps, StateFingerprints  # noqa: E402

NO_GRADS = GroupFps([], [])
from nondet.frameworks.torch.testing import recorder  # noqa: E402
from nondet.records import Group  # noqa: E402


def _torch_stats(t: torch.Tensor) -> tuple[float, float]:
    """What the torch path computes (hashing._stat_input, then sum and foreach_norm)."""
    r = torch.view_as_real(t) if t.is_complex() else t
    return (float(r.sum(dtype=torch.float64)),
            float(torch._foreach_norm([r], math.inf)[0].to(torch.float64)))


def _values(dtype: torch.dtype, n: int, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    if special and n >= 4:
        t[1], t[2] = float("inf"), -0.0
        t[3] = float("nan")
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.complex64, torch.complex128])
@pytest.mark.parametrize("n", [0, 1, 7, 100_003])
@pytest.mark.parametrize("special", [False, True])
def test_host_statistics_are_torchs(dtype: torch.dtype, n: int, special: bool) -> None:
    from nondet.frameworks.torch import hoststats

    t = _values(dtype, n, special)
    reals = hoststats.host_reals(t)
    assert reals is not None, "a plain dense CPU tensor takes the host path"
    total, maxabs = hoststats.stats(reals)
    want_total, want_max = _torch_stats(t) if n else (0.0, 0.0)
    if math.isnan(want_max):
        assert math.isnan(maxabs) and math.isnan(total)
        return
    assert maxabs == want_max and math.copysign(1, maxabs) == 1  # exact: no arithmetic
    assert total == pytest.approx(want_total, rel=1e-12, abs=1e-9)


def test_negative_zeros_have_max_abs_zero() -> None:
    from nondet.frameworks.torch import hoststats

    zeros = torch.tensor([-0.0, -0.0])  # kept: the view does not hold its memory
    reals = hoststats.host_reals(zeros)
    assert reals is not None
    assert hoststats.stats(reals) == (0.0, 0.0)
    assert math.copysign(1, hoststats.stats(reals)[1]) == 1


def test_tensors_numpy_cannot_read_keep_the_torch_path() -> None:
    from nondet.frameworks.torch import hoststats
    from nondet.frameworks.torch.hashing import TorchHasher

    base = torch.randn(6, 4, dtype=torch.float64)
    others = [base.to(torch.bfloat16), base.t(), torch.randn(5, dtype=torch.complex64).conj(),
              base[:, 1]]
    for t in others:
        assert hoststats.host_reals(t) is None
    for t, stats in zip(others, TorchHasher.stats_many(others), strict=True):
        assert stats is not None and all(isinstance(x, torch.Tensor) for x in stats)
        want = _torch_stats(t.resolve_conj())
        assert float(stats[1]) == want[1] and float(stats[0]) == pytest.approx(want[0])


class _Reductions(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
    """Counts the reductions (sums and norms) dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = str(func)
        if any(word in name for word in ("sum", "norm", "amax", "max.", "min.")):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _trained_state(width: int, hidden: int) -> tuple[Any, Any, Any]:
    """Named parameters, buffers and Adam state of a small model after one step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.BatchNorm1d(hidden),
                                torch.nn.Linear(hidden, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()
    names = {id(x): n for n, x in [*model.named_parameters(), *model.named_buffers()]}
    return named_state([model], [weakref.ref(optimizer)], names)


@pytest.mark.parametrize("detailed", [False, True])
def test_a_cpu_step_end_runs_no_torch_reduction(detailed: bool) -> None:
    """The parameter sum and (detailed steps) each tensor's sum and max |x| of a CPU model
    are computed by NumPy: a torch reduction would wake torch's OpenMP pool at every step
    end (milliseconds on a loaded machine). The values are torch's."""
    params, buffers, optim = _trained_state(300, 200)
    rec = recorder()
    state_fps = StateFingerprints(rec, rec.hasher)
    with torch.no_grad(), _Reductions() as seen:
        grads = state_fps.named([(n, p.grad) for n, p in params if p.grad is not None],
                                detailed)
        state, _ = state_fps.step_state(params, buffers, optim, grads, None, detailed)
    assert seen.seen == []
    want = sum(float(p.detach().sum(dtype=torch.float64)) for _, p in params)
    assert state.params_sum == pytest.approx(want, rel=1e-12)
    if detailed:
        tensors = {(group, n): t for group, named in (
            (Group.PARAM, params), (Group.BUFFER, buffers), (Group.OPTIM, optim),
            (Group.GRAD, [(n, p.grad) for n, p in params])) for n, t in named}
        rows = [r for r in state.tensors if r.numel and tensors[(r.group, r.name)]
                .is_floating_point()]
        assert len(rows) > 10
        assert {r.group for r in rows} == {Group.PARAM, Group.GRAD, Group.BUFFER, Group.OPTIM}
        for row in rows:
            total, maxabs = _torch_stats(tensors[(row.group, row.name)].detach())
            assert row.maxabs == maxabs and row.total == pytest.approx(total, rel=1e-12)


def test_the_step_rows_fingerprints_are_the_same_with_and_without_op_capture() -> None:
    """A step with op capture has a fingerprint per tensor as well, but its step row is the
    group's own fingerprint, as in a step without: ``nondet diff`` of a ``nondet run``
    capture and an ``--ops all`` one of the same deterministic script said "grads, params
    differ" at every step only one of them captured ops."""
    params, buffers, optim = _trained_state(30, 20)
    rows, tensors = [], []
    for detailed in (False, True):
        rec = recorder()
        state_fps = StateFingerprints(rec, rec.hasher)
        with torch.no_grad():
            grads = state_fps.named([(n, p.grad) for n, p in params if p.grad is not None],
                                    detailed)
            state, _ = state_fps.step_state(params, buffers, optim, grads, None, detailed)
        rows.append((state.params, state.buffers, state.grads, state.optim))
        tensors.append(len(state.tensors))
    assert rows[0] == rows[1] and all(rows[0])
    assert tensors[0] == 0 and tensors[1] > 10  # the detailed step still names its tensors


def test_a_parameter_numpy_cannot_read_sums_with_torch() -> None:
    """A bfloat16 parameter among float32 ones: the parameter sum is torch's."""
    params = [("a", torch.randn(50)), ("b", torch.randn(40).to(torch.bfloat16))]
    rec = recorder()
    state, _ = StateFingerprints(rec, rec.hasher).step_state(params, [], [], NO_GRADS, None, False)
    want = sum(float(p.sum(dtype=torch.float64)) for _, p in params)
    assert state.params_sum == pytest.approx(want, rel=1e-12)


def test_the_parameter_sum_is_the_same_float_with_and_without_statistics() -> None:
    """A detailed step reuses each parameter's sum from its statistics: the same float as
    a step-level step's, also where two parameters share a name (unnamed ones are "?")."""
    g = torch.Generator().manual_seed(3)
    params = [(name, torch.randn(n, generator=g)) for name, n in
              (("?", 70_000), ("?", 33), ("w", 5000), ("h", 12))]
    params.append(("bf", torch.randn(9, generator=g).to(torch.bfloat16)))  # the torch path
    rec = recorder()
    state_fps = StateFingerprints(rec, rec.hasher)
    sums = [state_fps.step_state(params[:4], [], [], NO_GRADS, None, detailed)[0].params_sum
            for detailed in (False, True)]
    assert sums[0] == sums[1]
    with_bf16 = [state_fps.step_state(params, [], [], NO_GRADS, None, detailed)[0].params_sum
                 for detailed in (False, True)]
    assert with_bf16[0] == with_bf16[1]


def test_statistics_of_many_arrays_are_those_of_each_alone() -> None:
    """``stats_many`` computes the small float16/float32 arrays' statistics together
    (one float64 array, ``reduceat``): the very floats ``stats`` gives each one alone
    (a step end's values must not depend on which other tensors it holds), with empty
    arrays, NaN, infinities and -0.0 among them and float64 and large arrays left apart."""
    import numpy as np

    from nondet.frameworks.torch import hoststats

    rng = np.random.default_rng(0)
    dtypes = [np.float16, np.float32, np.float64]
    for _ in range(20):
        arrays = []
        for _ in range(30):
            n = int(rng.choice([0, 1, 2, 7, int(rng.integers(1, 8192)), 8192, 20_000]))
            dtype = dtypes[int(rng.integers(0, 3))]
            scale = 10.0 ** int(rng.integers(-3, 4))
            a = (rng.standard_normal(n) * scale).astype(dtype)
            if n and rng.random() < 0.2:
                special = [np.nan, np.inf, -np.inf, -0.0][int(rng.integers(0, 4))]
                a[int(rng.integers(0, n))] = special
            arrays.append(a)
        with np.errstate(invalid="ignore", over="ignore"):
            got = hoststats.stats_many(arrays)
            want = [hoststats.stats(a) for a in arrays]
        assert len(got) == len(want)
        for a, pair, expected in zip(arrays, got, want, strict=True):
            same = [x == y or (math.isnan(x) and math.isnan(y))
                    for x, y in zip(pair, expected, strict=True)]
            assert all(same), f"{a.dtype} of {a.size}: {pair} != {expected}"
            assert [math.copysign(1, x) for x in pair] == [math.copysign(1, y) for y in expected]
