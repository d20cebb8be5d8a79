"""Host copies of op outputs for the parent: kept while a budget lasts (lockstep runs
measure a difference from them without re-running the script), or dumped for one op
(the dump pass), which then ends the run."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

from nondet.frameworks.base import Session
from nondet.frameworks.torch.state import to_numpy


class KeptOutputs:
    """The kept copies of one run. ``paused`` runs nondet's own torch work unrecorded."""

    def __init__(self, session: Session,
                 paused: Callable[[], AbstractContextManager[None]]) -> None:
        self.session = session
        self.paused = paused
        self._kept: dict[tuple[int, int], list[np.ndarray]] = {}
        self.kept_bytes = 0

    def keep(self, step: int, index: int, tensors: list[torch.Tensor]) -> None:
        """Keep a host copy of a record's outputs while the budget lasts (lockstep runs), so
        the parent can measure a difference without re-running the script."""
        budget = self.session.config.keep_bytes
        size = sum(t.numel() * t.element_size() for t in tensors)
        if not tensors or self.kept_bytes + size > budget:
            return
        with self.paused():
            self._kept[(step, index)] = [to_numpy(t) for t in tensors]
        self.kept_bytes += size

    def kept(self, step: int, index: int) -> list[np.ndarray]:
        return self._kept.get((step, index), [])

    def dump_and_exit(self, tensors: list[torch.Tensor]) -> None:
        """Save one op's outputs (the dump pass) and end the run right here."""
        with self.paused():
            for i, t in enumerate(tensors):
                session_step, index = self.session.config.dump
                self.session.send_dump(f"out{i}", to_numpy(t),
                                       {"step": session_step, "index": index,
                                        "torch_dtype": str(t.dtype)})
        self.session.finish("stopped", 0)
        os._exit(0)
