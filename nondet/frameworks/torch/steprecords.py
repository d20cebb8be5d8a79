"""The op records of the current step, as the torch recorder makes them: appended on the
thread that owns the op window, buffered per thread on autograd's worker threads and merged
in a fixed order (Note [Autograd worker threads] in threads.py), outputs kept or dumped when
the parent asked, and turned into OP_DTYPE rows once the step's fingerprints are final."""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np
import torch

from nondet.fingerprint import combine, scalar_value
from nondet.frameworks.base import RecorderHost
from nondet.frameworks.fp import Fp, combined
from nondet.frameworks.torch import tensors as safe
from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.threads import ThreadRecords
from nondet.records import OP_DTYPE, Kind


class TorchHost(RecorderHost, Protocol):
    """What the recorder asks of the torch backend (it never imports the backend)."""

    hasher: TorchHasher

    def tensor_name(self, t: torch.Tensor) -> str | None: ...

    def node_origin(self, node: Any) -> tuple[int, int]: ...

    def dump_and_exit(self, tensors: list[torch.Tensor]) -> None: ...

    def keep(self, step: int, index: int, tensors: list[torch.Tensor]) -> None: ...


_get_ident = threading.get_ident


class StepRecords:
    """The current step's records (the base of ``cache.FingerprintCache``)."""

    def __init__(self, backend: TorchHost) -> None:
        self.backend = backend
        self.session = backend.session
        self.records: list[tuple[Any, ...]] = []
        self.threads = ThreadRecords()  # records of autograd worker threads
        self.dump_at = self.session.config.dump
        self.keep_outputs = self.session.config.keep_bytes > 0

    def add(
        self, kind: Kind, phase: int, flags: int, name_id: int, module: int, source: int,
        outs: list[Fp], ins: list[Fp], taints: list[Fp], scalars: tuple[Any, ...],
        numel: int, tensors: list[torch.Tensor],
    ) -> None:
        record = (kind, phase, flags, name_id, module, source, outs, ins, taints, scalars,
                  numel)
        if _get_ident() != self.threads.owner:  # an autograd worker thread: merged later
            self.threads.buffer(record, tensors,
                                hold=self.keep_outputs or self.dump_at is not None)
            return
        self._append(record, tensors)

    def merge_threads(self) -> None:
        """Append records buffered on other threads (Note [Autograd worker threads])."""
        for record, tensors in self.threads.drain():
            self._append(record, tensors)

    def _append(self, record: tuple[Any, ...], tensors: list[torch.Tensor]) -> None:
        index = len(self.records)
        self.records.append(record)
        if self.dump_at is not None and self.dump_at == (self.session.step, index):
            self.backend.dump_and_exit(tensors)
        if self.keep_outputs and tensors and all(safe.keepable(t) for t in tensors):
            self.backend.keep(self.session.step, index, tensors)

    def take_rows(self, step: int) -> np.ndarray:
        """The current step's records as OP_DTYPE rows (call after ``resolve``)."""
        self.merge_threads()
        rows = [
            (step, i, kind, phase, flags, name, module, source, combined(outs),
             combined(ins), combined(taints),
             combine(scalar_value(s) for s in scalars) if scalars else 0, numel)
            for i, (kind, phase, flags, name, module, source, outs, ins, taints, scalars, numel)
            in enumerate(self.records)
        ]
        self.records = []
        return np.array(rows, dtype=OP_DTYPE) if rows else np.zeros(0, dtype=OP_DTYPE)
