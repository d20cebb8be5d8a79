"""Float statistics of step-level state computed on the host with NumPy: the parameter sum
of every step row, and the per-tensor sum and max |x| of detailed steps.

These numbers only size a difference (docs/architecture.md, growth), they never decide
one, so what they must be is deterministic (the same in both runs), not equal to those of
another implementation. On the CPU they used to be torch reductions, one or two per tensor
at every step end: each large one enters torch's OpenMP pool, whose barrier waits for the
other thread (milliseconds when the machine is loaded: measured 7.4 ms of CPU per step
end for the narrow benchmark model's parameter sum alone on 2 threads, 49 ms for a detailed
step end), and each small one costs a dispatch. NumPy reads the tensor's memory in place,
single-threaded, with no pool to wake. Accelerator tensors, wrapper subclasses, conjugate
or negative views and dtypes NumPy lacks (bfloat16, fp8) keep the torch path
(``hashing.TorchHasher.stats_many``), read back once per device with the fingerprints.
"""

from __future__ import annotations

import numpy as np
import torch

from nondet.frameworks.torch.hostwords import raw_bytes
from nondet.frameworks.torch.leaves import functorch_inner

#: NumPy's type of a dtype's real values (complex: the real and imaginary parts, as
#: ``torch.view_as_real`` lays them out).
_NP_REALS: dict[torch.dtype, type[np.floating]] = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.complex128: np.float64, torch.complex64: np.float32,
}


def host_reals(t: torch.Tensor) -> np.ndarray | None:
    """The real floating values of a plain, dense, contiguous CPU tensor as a NumPy view
    of its memory (valid while ``t`` keeps it: ``hostwords.raw_bytes``), or None where the
    torch path must compute its statistics."""
    t = functorch_inner(t)
    kind = type(t)
    if ((kind is not torch.Tensor and kind is not torch.nn.Parameter) or not t.is_cpu
            or t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_conj()
            or t.is_neg() or not t.is_contiguous()):
        return None
    real = _NP_REALS.get(t.dtype)
    return None if real is None else raw_bytes(t).view(real)


def real_sum(values: np.ndarray) -> float:
    """The float64 sum of ``values`` (NumPy's pairwise summation: a fixed order)."""
    return float(np.add.reduce(values, dtype=np.float64)) if values.size else 0.0


def stats(values: np.ndarray) -> tuple[float, float]:
    """(sum, max |x|) of ``values``: the max without an array of absolute values (two
    reductions that write nothing). NaN anywhere makes both NaN, as torch's do."""
    if not values.size:
        return 0.0, 0.0
    return real_sum(values), _maxabs(float(values.max()), float(values.min()))


def _maxabs(high: float, low: float) -> float:
    # max() propagates NaN, so ``high`` is NaN exactly when some value is; abs() turns a
    # -0.0 into the 0.0 torch's norm gives
    return high if high != high else abs(high if high >= -low else low)


#: float16 and float32 arrays (complex64's parts too) below this many elements have their
#: statistics computed together (``stats_many``); NumPy's reductions cast such an array to
#: float64 in one buffer of 8192 elements, so the sum is the one ``stats`` gives.
_TOGETHER_BELOW = 8192


def stats_many(arrays: list[np.ndarray]) -> list[tuple[float, float]]:
    """``stats`` of each array, the same floats. A detailed step end has them for every
    parameter, gradient, buffer and optimizer state (about 90 on the narrow benchmark
    model, most of them small: biases, batch-norm weights, Adam's step counters), and
    three NumPy calls per small array cost more than their arithmetic: the small float16
    and float32 ones are widened into one float64 array (exact) and reduced segment by
    segment (``reduceat``), which sums each segment as ``np.add.reduce`` with
    ``dtype=float64`` sums the array (a pairwise sum over one buffer: checked on 12,000
    random arrays of 1-8191 elements with NaN, infinities and -0.0, and in
    tests/frameworks/test_torch_hoststats.py). float64 arrays are summed one by one: NumPy
    sums those unbuffered, in a different order than ``reduceat``."""
    together = [i for i, a in enumerate(arrays)
                if 0 < a.size < _TOGETHER_BELOW and a.dtype.itemsize < 8]
    out: list[tuple[float, float] | None] = [None] * len(arrays)
    if len(together) > 1:
        parts = [arrays[i] for i in together]
        values = np.concatenate(parts, dtype=np.float64)
        starts = np.zeros(len(parts), dtype=np.intp)
        np.cumsum([p.size for p in parts[:-1]], out=starts[1:])
        sums = np.add.reduceat(values, starts).tolist()
        highs = np.maximum.reduceat(values, starts).tolist()
        lows = np.minimum.reduceat(values, starts).tolist()
        for i, total, high, low in zip(together, sums, highs, lows, strict=True):
            # + 0.0: NumPy's reduce starts from +0.0, so -0.0s alone sum to 0.0
            out[i] = (total + 0.0, _maxabs(high, low))
    return [stats(a) if pair is None else pair for a, pair in zip(arrays, out, strict=True)]
