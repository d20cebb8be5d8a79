"""Entries proven unread (nondet/frameworks/torch/unread.py): only a tensor dropped in the
expression that made it, having given up only its metadata, is unread; any other use counts
as a read."""

from __future__ import annotations

import sys
from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from nondet.frameworks.torch import unread  # noqa: E402


class Maker:
    """Stands in for nondet's creation wrapper: makes the tensor, watches it from the
    caller's frame, and notes whether it was proven unread."""

    def __init__(self) -> None:
        self.unread = False
        self.watchers: list[Any] = []

    def __call__(self, a: Any) -> Any:
        t = torch.from_numpy(a)
        self.watchers.append(unread.watch(t, sys._getframe(1), self._mark))
        return t

    def _mark(self) -> None:
        self.unread = True


def test_a_tensor_used_only_for_its_dtype_is_unread() -> None:
    make = Maker()
    dtype = make(np.empty([], dtype=np.float32)).dtype
    assert dtype == torch.float32 and make.unread


def test_a_tensor_dropped_by_its_statement_is_unread() -> None:
    make = Maker()
    make(np.empty(3, dtype=np.float32))
    assert make.unread


def test_a_temporary_consumed_by_an_op_is_read() -> None:
    make, model = Maker(), torch.nn.Linear(3, 1)
    model(make(np.ones(3, dtype=np.float32)).float())
    assert make.watchers == [None] and not make.unread


def test_a_kept_tensor_is_read_even_if_dropped_later() -> None:
    make = Maker()
    t = make(np.ones(3, dtype=np.float32))
    assert make.watchers == [None]
    del t
    assert not make.unread


def test_a_temporary_passed_on_is_read() -> None:
    make = Maker()
    total = torch.add(make(np.ones(3, dtype=np.float32)), 1)
    assert float(total.sum()) == 6.0 and not make.unread
