"""The op recorder's fingerprint cache: a hit only while the tensor is exactly what was
hashed (Note [Fingerprint cache], Note [Version bumps after the op] in torch/cache.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch
from torch.utils._python_dispatch import _disable_current_modes

from nondet.fingerprint import combine, scalar_value
from nondet.frameworks.torch import tensors as safe
from nondet.frameworks.torch.testing import count_hashes, recorder, recording


def _fresh_value(t: torch.Tensor) -> int:
    """The fingerprint of ``t``'s current values, taken by a recorder of its own."""
    other = recorder()
    with _disable_current_modes():
        fp = other.fingerprint(t)
        other.resolve()
    assert fp.value is not None
    return fp.value


def test_a_tensor_an_op_wrote_is_not_hashed_again_at_its_next_read() -> None:
    """The version bump of an in-place op comes after the recorder returned; it is taken
    into the entry at the next op, so the next reader uses the cached fingerprint."""
    with recording() as recorder:
        x = torch.ones(1000) * 3
        hashed = count_hashes(recorder, x)
        for _ in range(3):
            x.mul_(2)  # a recorded write (pointwise: its fingerprint is derived, not hashed)
            x.sum()  # a read: a cache hit
    assert not hashed, f"x hashed again {len(hashed)} times after writes the recorder saw"


def test_a_write_outside_the_ops_after_a_recorded_write_is_seen() -> None:
    """Settling takes exactly one version bump: one more (a write the recorder did not see)
    leaves the entry stale, and the next read hashes the tensor afresh."""
    with recording() as recorder:
        x = torch.ones(8) * 3
        x.add_(1)  # recorded
        with _disable_current_modes():
            x.add_(1)  # not recorded: bumps the version once more
        x * 2
    rows = recorder.take_rows(0)
    read = rows[-1]  # the record of x * 2: its input is x as it is now (5.0)
    assert int(read["in_fp"]) == _fresh_value(torch.full((8,), 5.0))


def test_a_view_of_a_written_tensor_is_not_hashed_at_its_first_read() -> None:
    """A view shares its base's version counter only after the recorder returned (Note
    [Views share their base's version]): settled at the next op, its first read takes the
    derived fingerprint (the transposed weight a linear layer's backward reads)."""
    with recording() as recorder:
        w = torch.ones(16, 8) * 3
        w.mul_(2)  # written: its version is no longer 0
        v = w.t()
        hashed = count_hashes(recorder, v)
        torch.mm(v, torch.ones(16, 4))
    assert not hashed, "the view was hashed again at its first read"


@pytest.mark.parametrize("recorded", [True, False])
def test_a_view_whose_base_is_written_after_it_is_hashed_afresh(recorded: bool) -> None:
    """A write to the base between the view op and the view's read, recorded or not (a
    version bump the recorder did not see), leaves the view's entry stale: the read hashes
    the values the view shows then."""
    with recording() as recorder:
        x = torch.ones(8) * 3
        x.add_(1)
        v = x.view(2, 4)
        if recorded:
            x.add_(1)
        else:
            with _disable_current_modes():
                x.add_(1)
        v * 2
    rows = recorder.take_rows(0)
    assert int(rows[-1]["in_fp"]) == _fresh_value(torch.full((2, 4), 5.0))


def test_a_tensor_given_another_storage_without_a_version_bump_is_hashed_again() -> None:
    """``x.data = y`` swaps the storage without bumping ``x``'s version counter; the entry
    names its storage object, so the next read cannot take the old fingerprint."""
    with recording() as recorder:
        x = torch.ones(8) * 3
        y = torch.full((8,), 5.0) + 0  # recorded: its storage is known, never written
        x.data = y
        x * 2
    rows = recorder.take_rows(0)
    assert int(rows[-1]["in_fp"]) == _fresh_value(torch.full((8,), 5.0))


def test_host_fingerprints_are_final_at_once_with_the_step_end_value() -> None:
    """A CPU tensor's fingerprint is final when hashed, with the value ``Fp.finalize``
    gives at the step end (content and description combined)."""
    tensors = [torch.randn(3, 4), torch.tensor(2.5), torch.arange(7, dtype=torch.int16),
               torch.nn.Parameter(torch.randn(5)), torch.zeros(0), torch.randn(6)[1:]]
    with recording() as recorder:
        for t in tensors:
            fp = recorder.fingerprint(t)
            content = recorder.hasher.content(t)
            assert fp.value == combine((int(content) & (1 << 64) - 1,  # type: ignore[arg-type]
                                        *safe.describe(t)))


def test_derived_fingerprints_packed_at_once_have_the_step_end_value() -> None:
    """A pointwise op's output fingerprint, packed from its kept description (Note [Packed
    descriptions]), is the value ``Fp.finalize`` computes from parents and description:
    with 0-3 parents, scalar arguments (floats by their bits: -0.0 is not 0.0), and
    descriptions seen before or not."""
    from nondet.frameworks.fp import Fp
    from nondet.frameworks.torch.optable import op_info

    a, b, c = torch.randn(3, 4), torch.randn(3, 4), torch.randn(4)
    cases = [
        (torch.ops.aten.mul.Tensor, [a, b], [], torch.empty(3, 4)),
        (torch.ops.aten.mul.Tensor, [a, b], [], torch.empty(3, 4)),  # description known
        (torch.ops.aten.add.Tensor, [a, b], [0.5], torch.empty(3, 4)),
        (torch.ops.aten.add.Tensor, [a, b], [-0.0], torch.empty(3, 4)),
        (torch.ops.aten.add.Tensor, [a, b], [0.0, 3, True], torch.empty(3, 4)),
        (torch.ops.aten.neg.default, [c], [], torch.empty(4, dtype=torch.float64)),
        (torch.ops.aten.addcmul.default, [a, b, a], [2], torch.empty(3, 4)),
        (torch.ops.aten.fill.Scalar, [], [1.5], torch.empty(2)),
        (torch.ops.aten.where.self, [a, b, a, b], [], torch.empty(3, 4)),
    ]
    with recording() as recorder:
        parents = {id(t): recorder.fingerprint(t) for t in (a, b, c)}
        for func, inputs, scalars, out in cases:
            info = op_info(func, 0)
            fp = recorder.derive_output(info, [parents[id(t)] for t in inputs], scalars, out)
            expected = Fp()
            expected.parents = tuple(parents[id(t)] for t in inputs)
            expected.meta = fp.meta
            expected.finalize()
            assert fp.value is not None and fp.value == expected.value, (func, scalars)
            assert expected.meta == (info.code, *safe.describe(out),
                                     *(scalar_value(s) for s in scalars))


def test_resizing_like_another_tensor_leaves_uninitialized_memory_it_overwrites() -> None:
    """Trial round 18: linear_operator's conjugate gradients ``resize_as_`` a fresh tensor
    and ``copy_`` into it at once; the bytes ``resize_as_`` left differed between the runs
    and were noted as a difference "that never reached training". ``resize_as_`` is
    ``resize_`` to another tensor's size: its output is uninitialized memory, as
    ``resize_``'s is."""
    from nondet.frameworks.torch.optable import op_info

    for func in (torch.ops.aten.resize_.default, torch.ops.aten.resize_as_.default):
        info = op_info(func, 0)
        assert info.uninit_output and 0 in info.overwritten_args, func
