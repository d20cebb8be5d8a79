"""A stand-in for the torch backend, so the op recorder can run in this process without
hooks, a parent process or a capture file: for tests (tests/frameworks/) and the
in-process benchmark (bench/torch_inprocess.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.ops import OpRecorder
from nondet.frameworks.torch.state import to_numpy
from nondet.records import Phase


class FakeSession:
    """What the recorder reads of the Session: config, step, source lines, strings."""

    def __init__(self, keep_bytes: int) -> None:
        self.config = SimpleNamespace(dump=None, keep_bytes=keep_bytes)
        self.step = 0
        self.sources = SimpleNamespace(here=lambda depth=2: -1)  # no source lines
        self.strings: list[str] = []  # string id -> text
        self._ids: dict[str, int] = {}

    def intern(self, text: str) -> int:
        sid = self._ids.get(text)
        if sid is None:
            sid = self._ids[text] = len(self.strings)
            self.strings.append(text)
        return sid


class FakeHost:
    """The part of TorchBackend the recorder calls (``cache.TorchHost``). ``keep``: keep
    every op's outputs as the lockstep schedule does (host copies made and dropped)."""

    def __init__(self, keep: bool = False) -> None:
        self.session = FakeSession(1 << 20 if keep else 0)
        self.hasher = TorchHasher()
        self.phase = Phase.FORWARD
        self.disabled = False
        self.forward_in_backward_at: int | None = None
        self.backward_call_source = -1

    def current_module(self) -> int:
        return -1

    def node_origin(self, node: Any) -> tuple[int, int]:
        return -1, -1

    def tensor_name(self, t: torch.Tensor) -> str | None:
        return None

    def keep(self, step: int, index: int, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            to_numpy(t)

    def dump_and_exit(self, tensors: list[torch.Tensor]) -> None:
        raise AssertionError("no dump was asked for")


class RecordMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
    """Every op to the recorder (``ops.CaptureMode`` without its pass-through cases)."""

    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        try:
            return self.recorder.dispatch(func, args, kwargs or {})
        finally:
            self.recorder.op_out = None  # as CaptureMode: the op's output is not kept alive


class KernelHost:
    """What kernels.KernelCalls asks of the backend, for a recorder driven by ``mode``."""

    def __init__(self, rec: OpRecorder, mode: TorchDispatchMode) -> None:
        self.recorder = rec
        self.mode = mode
        self.disabled = False
        self.paused = False
        self.failures = 0  # hook_failed calls (nondet's own errors)

    @property
    def session(self) -> Any:
        return self.recorder.session

    @property
    def phase(self) -> Phase:
        return Phase.OPTIMIZER

    def current_module(self) -> int:
        return -1

    def hook_failed(self) -> None:
        self.failures += 1
        self.disabled = True
        self.recorder.window = self.recorder.active = False


def recorder(keep: bool = False) -> OpRecorder:
    return OpRecorder(FakeHost(keep))  # type: ignore[arg-type]  # a partial host


@contextmanager
def recording(keep: bool = True) -> Iterator[OpRecorder]:
    """A recorder with its op window open and every op in the block recorded; pending
    fingerprints are resolved when the block ends."""
    rec = recorder(keep)
    rec.open_window()
    with RecordMode(rec):
        yield rec
    rec.resolve()


def count_hashes(rec: OpRecorder, watched: torch.Tensor) -> list[int]:
    """Make ``rec`` note each time it hashes ``watched``: the returned list grows by one."""
    hashed: list[int] = []
    original = rec.fingerprint

    def spy(t: torch.Tensor, fp: Any = None) -> Any:
        if t is watched:
            hashed.append(1)
        return original(t, fp)

    rec.fingerprint = spy  # type: ignore[method-assign]
    return hashed
