"""The op records of the current step, as the torch recorder makes them: appended on the
thread that owns the op window, buffered per thread on autograd's worker threads and merged
in a fixed order (Note [Autograd worker threads] in threads.py), outputs kept or dumped when
the parent asked, and turned into OP_DTYPE rows once the step's fingerprints are final."""

from __future__ import annotations

import hashlib
import struct
import threading
from typing import Any, Protocol

import numpy as np
import torch

from nondet.fingerprint import MASK64, combine, scalar_value
from nondet.frameworks.base import RecorderHost
from nondet.frameworks.fp import Fp, combined
from nondet.frameworks.torch import tensors as safe
from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.threads import ThreadRecords
from nondet.records import OP_DTYPE, Kind


class TorchHost(RecorderHost, Protocol):
    """What the recorder asks of the torch backend (it never imports the backend)."""

    hasher: TorchHasher
    #: not None while forward code runs inside a backward (TorchBackend's module hooks)
    forward_in_backward_at: int | None
    backward_call_source: int  # ... and the script's line that called that backward

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
        """The current step's records as OP_DTYPE rows (call after ``resolve``), built
        column by column (Note [Op rows at the step end])."""
        self.merge_threads()
        records, self.records = self.records, []
        if not records:
            return np.zeros(0, dtype=OP_DTYPE)
        (kinds, phases, flags, names, modules, sources, outs, ins, taints, scalars,
         numels) = zip(*records, strict=True)
        rows = np.empty(len(records), dtype=OP_DTYPE)
        rows["step"] = step
        rows["index"] = np.arange(len(records))
        rows["kind"] = kinds
        rows["phase"] = phases
        rows["flags"] = flags
        rows["name"] = names
        rows["module"] = modules
        rows["source"] = sources
        rows["out_fp"] = [_combined(fps) for fps in outs]
        rows["in_fp"] = [_combined(fps) for fps in ins]
        rows["taint_fp"] = [_combined(fps) if fps else 0 for fps in taints]
        rows["scalar_fp"] = [_scalars_fp(values) if values else 0 for values in scalars]
        rows["numel"] = numels
        return rows


# Note [Op rows at the step end]
# A captured step ends by turning its records (~270 on the narrow benchmark model) into
# rows: a record's inputs, outputs and scalar arguments each become one 64-bit value. The
# values are those of ``fp.combined`` and ``combine(scalar_value(s) ...)``, computed with
# less Python per record: the common one- and two-fingerprint cases pack their words
# directly (the same bytes ``combine`` hashes), the fingerprint of a record's scalars is
# remembered by the scalars' own fingerprints (a step passes the same few: learning rate,
# betas, ``alpha=1``; an integer's fingerprint by the integer), and the structured array is
# filled column by column instead of from one tuple per row. Measured in one process
# (1 thread): 0.9 -> 0.5 ms per step of the narrow model (docs/benchmarks.md, "Fifth round").
_blake2b = hashlib.blake2b
_PAIR = struct.Struct("<2Q")
#: The combined fingerprint of a record's scalars by their fingerprints (scalar_value
#: remembers those of floats and ints); capped.
_SCALAR_FPS: dict[tuple[int, ...], int] = {}
_CAP = 4096


def _combined(fps: list[Fp]) -> int:
    """``fp.combined(fps)``."""
    if len(fps) == 1:
        return fps[0].value or 1
    if len(fps) == 2:
        digest = _blake2b(_PAIR.pack((fps[0].value or 0) & MASK64,
                                     (fps[1].value or 0) & MASK64), digest_size=8).digest()
        return int.from_bytes(digest, "little") or 1
    return combined(fps)


def _scalars_fp(values: tuple[Any, ...]) -> int:
    """``combine(scalar_value(v) for v in values)``."""
    key = tuple([scalar_value(value) for value in values])
    total = _SCALAR_FPS.get(key)
    if total is None:
        total = combine(key)
        if len(_SCALAR_FPS) < _CAP:
            _SCALAR_FPS[key] = total
    return total
