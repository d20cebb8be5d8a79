"""A captured step's op rows (Note [Op rows at the step end] in torch/steprecords.py): built
with less Python per record, with the values of the plain definition."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import torch

from nondet.fingerprint import combine, scalar_value
from nondet.frameworks.fp import Fp, combined
from nondet.frameworks.torch.testing import recorder, recording
from nondet.records import OP_DTYPE, Kind


def _reference_rows(step: int, records: list[tuple[Any, ...]]) -> np.ndarray:
    """The rows as the definition states them: one tuple per record."""
    rows = [(step, i, kind, phase, flags, name, module, source, combined(outs),
             combined(ins), combined(taints),
             combine(scalar_value(s) for s in scalars) if scalars else 0, numel)
            for i, (kind, phase, flags, name, module, source, outs, ins, taints, scalars,
                    numel) in enumerate(records)]
    return np.array(rows, dtype=OP_DTYPE)


def _fps(*values: int) -> list[Fp]:
    return [Fp(value=v) for v in values]


def test_rows_have_the_values_of_the_definition_for_every_kind_of_argument() -> None:
    """One, two and more fingerprints (0 among them: no information), no inputs, taints,
    and scalars that compare equal but differ in kind or bits (True and 1, 0.0 and -0.0,
    NaN, large and negative integers, complex), twice over (the second time from the
    remembered scalar fingerprints)."""
    rec = recorder()
    top = (1 << 64) - 1
    cases: list[tuple[list[Fp], list[Fp], list[Fp], tuple[Any, ...]]] = [
        (_fps(5), _fps(7, 9), [], ()),
        (_fps(0), _fps(top, 0), _fps(3), (1,)),
        (_fps(1, 2), _fps(3, 4, 5), _fps(6, 7), (True,)),
        ([], [], [], (0.0,)),
        (_fps(11), _fps(12), [], (-0.0,)),
        (_fps(11), _fps(12), [], (math.nan, 2)),
        (_fps(13), [], [], (1 << 70, -5, 2.5j)),
        (_fps(14, 15, 16, 17), _fps(18), [], (1, True, 1.0)),
    ]
    records = []
    for outs, ins, taints, scalars in cases * 2:
        rec.add(Kind.OP, 1, 0, 3, 4, 5, outs, ins, taints, scalars, 10, [])
        records.append((Kind.OP, 1, 0, 3, 4, 5, outs, ins, taints, scalars, 10))
    rows = rec.take_rows(7)
    assert rows.dtype == OP_DTYPE
    assert rows.tobytes() == _reference_rows(7, records).tobytes()
    # scalars equal as Python values but not as arguments keep different fingerprints
    assert len({int(r) for r in rows["scalar_fp"][:8]}) == 8
    assert len(rec.take_rows(8)) == 0  # taken: the next step starts empty


def test_a_recorded_training_step_has_the_rows_of_the_definition() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with recording() as rec:
        loss = model(torch.randn(8, 6)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    records = list(rec.records)
    assert len(records) > 50 and any(r[9] for r in records)  # ops with scalars among them
    assert rec.take_rows(0).tobytes() == _reference_rows(0, records).tobytes()
