"""The CUDA-only parts of torch capture: streams, CUDA graphs, the per-step synchronize.

Everything that calls ``torch.cuda`` goes through ``api`` (tests replace it with a fake:
this project's machines have no GPU; ``tests/gpu/`` runs the real thing, ``make gpu-check``).
Nothing here initializes CUDA: every function first asks whether the script already did.

Note [Streams]
Hash kernels run on the stream that is current when an op's output is fingerprinted, i.e.
the stream the op itself ran on, so they are ordered after the op that wrote the tensor.
Their scratch buffers are therefore kept per (device, stream) (``stream_key``): one buffer
shared by two streams would be written by both at once. The 0-dim sums they leave are read
on whatever stream is current at the step end: ``synchronize`` waits for every stream of
each device once, right before the per-step read-back, and ``hand_over`` marks them as used
by that stream (``record_stream``) so the caching allocator does not give their memory to
the side stream's next kernel while the read is queued. Key buffers that are replaced while
kernels on some stream may still read them are ``retire``d: kept alive until the next
synchronize instead of freed.

Note [CUDA graphs]
While a stream is capturing (``torch.cuda.graph``, ``make_graphed_callables``,
``mode="reduce-overhead"``), kernels are recorded, not run: a hash kernel would be captured
into the user's graph (and replayed with it), its result read on the host would be garbage,
and allocating a key buffer raises inside capture. So during capture ops pass through
unrecorded (``capturing``), step hooks do nothing, and the tensors the captured ops write
are remembered (``GraphOutputs``). A replay writes them without any dispatch, so every
replay makes the recorder forget them: their next eager use fingerprints them afresh, as an
entry point. Key buffers on CUDA are allocated at full size on first use, never grown.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from nondet.frameworks.fp import Fp

#: The ``torch.cuda`` functions used here (replaced by a fake in tests).
api: Any = torch.cuda
#: Buffers kept alive until the next synchronize (Note [Streams]).
_retired: list[torch.Tensor] = []


def in_use() -> bool:
    """Whether the script has initialized CUDA (cheap; never initializes it)."""
    return bool(api.is_available() and api.is_initialized())


def capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (Note [CUDA graphs])."""
    if not api.is_initialized():
        return False
    try:
        return bool(api.is_current_stream_capturing())
    except RuntimeError:  # a CUDA error is the script's to meet, not nondet's
        return False


def stream_key(device: torch.device) -> Hashable:
    """What scratch buffers are kept per: the device, and on CUDA its current stream."""
    if device.type != "cuda":
        return device
    return device, api.current_stream(device).stream_id


def retire(buffer: torch.Tensor | None) -> None:
    """Keep a replaced device buffer alive until the next ``synchronize``."""
    if buffer is not None and buffer.device.type == "cuda":
        _retired.append(buffer)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait once for all streams of each CUDA device in ``devices`` (before a read-back)."""
    waited = False
    for device in {d for d in devices if d.type == "cuda"}:
        api.synchronize(device)
        waited = True
    if waited:
        _retired.clear()


@contextmanager
def own_syncs() -> Iterator[None]:
    """nondet's per-step read-back synchronizes with the device on purpose: a script that
    makes host syncs an error or a warning (``torch.cuda.set_sync_debug_mode``) means its
    own, so the mode is off while nondet reads, and restored after."""
    mode = 0
    if in_use():
        try:
            mode = int(api.get_sync_debug_mode())
        except (AttributeError, RuntimeError):
            mode = 0
        if mode:
            api.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            api.set_sync_debug_mode(mode)


def hand_over(tensors: Iterable[torch.Tensor]) -> None:
    """Mark CUDA tensors as used by the current stream of their device (Note [Streams])."""
    for t in tensors:
        if t.device.type == "cuda":
            t.record_stream(api.current_stream(t.device))


def crosses_devices(args: Iterable[Any], outputs: Iterable[torch.Tensor]) -> bool:
    """Whether a copy op moves data between devices (its output is then hashed, not
    derived: a racing non-blocking copy must be found at the copy)."""
    out_devices = {t.device for t in outputs}
    for value in args:
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor) and item.device not in out_devices:
                return True
    return False


def _tensors(value: Any) -> list[torch.Tensor]:
    items = value if isinstance(value, (list, tuple)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def pass_captured(recorder: Any, func: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    """Run an op that is being captured into a CUDA graph, unrecorded and unhashed: its new
    outputs are uninitialized until a replay writes them, and every tensor it writes is
    forgotten at each replay (Note [CUDA graphs]). ``recorder``: the OpRecorder."""
    out = recorder.run_op(func, args, kwargs)
    info = recorder.info(func)
    if info.view:  # an alias: what is known about its base still holds
        return out
    written = _tensors(out)
    inputs = [t for value in (*args, *kwargs.values()) for t in _tensors(value)]
    for t in written:
        if not any(t is x for x in inputs):  # an in-place op returns its input: not new
            recorder.remember(t, Fp(uninit=True))
    for position in info.mutated_args:
        if position < len(args):
            written += _tensors(args[position])
    for key in info.mutated_kwargs:
        written += _tensors(kwargs.get(key))
    recorder.graph_outputs.add(written)
    return out


class GraphOutputs:
    """Tensors written by ops seen during CUDA graph capture (weakly held), forgotten by
    the recorder at every replay (Note [CUDA graphs])."""

    def __init__(self, forget: Callable[[torch.Tensor], None]) -> None:
        self._forget = forget
        self._tensors: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary())

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._tensors[id(t)] = t

    def replayed(self) -> None:
        for t in list(self._tensors.values()):
            self._forget(t)

    def __len__(self) -> int:
        return len(self._tensors)


def install_replay_hook(outputs: GraphOutputs, enabled: Callable[[], bool],
                        guarded: Callable[[], AbstractContextManager[None]]) -> None:
    """Wrap ``CUDAGraph.replay`` so each replay forgets the captured outputs first (inside
    ``guarded``: nondet's trouble never reaches the script). Only patches the class if
    this torch has one; never touches CUDA itself."""
    graph_class = getattr(api, "CUDAGraph", None)
    original = getattr(graph_class, "replay", None)
    if original is None or getattr(original, "_nondet", False):
        return

    @functools.wraps(original)
    def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
        if enabled() and len(outputs):
            with guarded():
                outputs.replayed()
        return original(self, *args, **kwargs)

    replay._nondet = True  # type: ignore[attr-defined]
    graph_class.replay = replay  # type: ignore[union-attr]
