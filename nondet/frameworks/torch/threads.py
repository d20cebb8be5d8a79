"""Op records made on other threads, merged into the step in an order that does not
depend on thread timing.

Note [Autograd worker threads]
The autograd engine runs a backward pass with one worker thread per device (the CPU part
on the calling thread) and hands each the dispatch modes of the caller, so ``CaptureMode``
sees ops from several threads at once. Appended to one list as they come, their records
would interleave in GIL order, different in every run: a false "structure" finding. So the
thread that opened the op window (the owner) appends directly, every other thread into
its own buffer, and the buffers are merged after the backward pass (and at the latest at
the step end): ordered by the device the thread worked on, then by the sequence of op
names it ran; within a buffer, in the thread's own order. A thread's own order is the
engine's order for that device, the same in both runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

#: One op record (OpRecorder.add's fields) and the tensors it may keep or dump.
Entry = tuple[tuple[Any, ...], list[torch.Tensor]]
_NAME = 3  # the position of the name id in a record


class _Buffer:
    __slots__ = ("device", "entries", "order")

    def __init__(self, order: int) -> None:
        self.device: tuple[str, int] | None = None
        self.entries: list[Entry] = []
        # Creation order: breaks ties between threads on one device, which the autograd
        # engine does not make (one worker per device); then it is as timing-dependent
        # as the records were.
        self.order = order

    def key(self) -> tuple[Any, ...]:
        device = self.device or ("~", -1)  # threads that produced no tensor: last
        return device, tuple(int(record[_NAME]) for record, _ in self.entries), self.order


class ThreadRecords:
    """Per-thread buffers of op records made off the owner thread (see the Note)."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self._buffers: dict[int, _Buffer] = {}

    def claim(self) -> None:
        """The calling thread becomes the owner (the op window opens on it)."""
        self.owner = threading.get_ident()

    def on_owner(self) -> bool:
        return threading.get_ident() == self.owner

    def buffer(self, record: tuple[Any, ...], tensors: Sequence[torch.Tensor],
               hold: bool) -> None:
        """Keep a record made on another thread until the next ``drain``; its tensors only
        if ``hold`` (they may be kept or dumped): holding every output would raise the peak
        memory of the backward pass."""
        ident = threading.get_ident()
        buf = self._buffers.get(ident)
        if buf is None:
            buf = self._buffers.setdefault(ident, _Buffer(len(self._buffers)))
        if buf.device is None and tensors:
            device = tensors[0].device
            buf.device = (device.type, -1 if device.index is None else device.index)
        buf.entries.append((record, list(tensors) if hold else []))

    def drain(self) -> list[Entry]:
        """Every buffered record, in the fixed merge order; the buffers are emptied."""
        if not self._buffers:
            return []
        buffers, self._buffers = self._buffers, {}
        return [entry for buf in sorted(buffers.values(), key=_Buffer.key)
                for entry in buf.entries]
