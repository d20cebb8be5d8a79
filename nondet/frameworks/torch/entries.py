"""Data entering a torch run from outside its recorded ops: DataLoader batches, and tensors
made from NumPy or Python values (``torch.from_numpy``, ``as_tensor``, ``tensor``,
``frombuffer``). Each is an *entry point* in the op records and a data entry of its step,
named with the user's line; a loader's settings become facts for the recipe matcher.
"""

from __future__ import annotations

import functools
import sys
import weakref
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import torch

from nondet.frameworks.base import DataEntry, RecorderHost
from nondet.frameworks.fp import Fp
from nondet.frameworks.torch import unread
from nondet.frameworks.torch.ops import OpRecorder
from nondet.frameworks.torch.state import leaf_tensors
from nondet.records import Kind, Phase


class EntryHost(RecorderHost, Protocol):
    """What the entry hooks ask of the torch backend (they never import the backend)."""

    paused: bool
    recorder: OpRecorder
    module_stack: list[int]

    def guarded(self) -> AbstractContextManager[None]: ...

    def paused_capture(self) -> AbstractContextManager[None]: ...

    def before_batch(self) -> None: ...

    def add_data(self, label: str, fps: list[Fp], numel: int) -> None: ...

    def data_entry(self, label: str, fps: list[Fp], numel: int) -> DataEntry: ...

#: Functions that make tensors from outside data, and the entry kind they make (None: by
#: the type of the data).
CREATION_FUNCTIONS = (("from_numpy", "numpy"), ("as_tensor", None), ("tensor", None),
                      ("frombuffer", "numpy"))


class DataEntries:
    """Installs the hooks and records what enters (see the module docstring)."""

    def __init__(self, backend: EntryHost) -> None:
        self.backend = backend
        self.loaders: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.loader_of_iter: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def install(self) -> None:
        from torch.utils.data import dataloader

        backend = self.backend
        original_iter = dataloader.DataLoader.__iter__

        @functools.wraps(original_iter)
        def loader_iter(loader: Any) -> Any:
            iterator = original_iter(loader)
            if not backend.disabled:
                with backend.guarded():
                    try:
                        self.loader_of_iter[iterator] = self._loader_index(loader)
                    except TypeError:  # not weak-referenceable (custom iterator)
                        pass
            return iterator

        dataloader.DataLoader.__iter__ = loader_iter  # type: ignore[method-assign]

        original_next = dataloader._BaseDataLoaderIter.__next__

        @functools.wraps(original_next)
        def loader_next(iterator: Any) -> Any:
            if backend.disabled or backend.paused:
                return original_next(iterator)
            with backend.guarded():
                backend.before_batch()
            recorder = backend.recorder
            previous, backend.phase = backend.phase, Phase.DATA
            # With worker processes the main process only rebuilds tensors from shared
            # memory: not computation worth recording; the batch itself is the entry.
            recording = recorder.active
            if getattr(iterator, "_num_workers", 0) > 0:
                recorder.active = False
            try:
                batch = original_next(iterator)
            finally:
                backend.phase = previous
                recorder.active = recording and not backend.disabled
            with backend.guarded():
                self._record_batch(iterator, batch)
            return batch

        dataloader._BaseDataLoaderIter.__next__ = loader_next  # type: ignore[method-assign,assignment]

        # torch.device(...) contexts and set_default_device recognise the constructors they
        # place by identity, in a set built once from the torch.* attributes: built after the
        # wrappers below, torch.tensor/as_tensor would stay on the CPU inside
        # `with torch.device("meta")` (HF from_pretrained then never initializes non-persistent
        # buffers: garbage position_ids). Build it now, from the originals, which the wrappers
        # call.
        try:
            from torch.utils._device import _device_constructors

            _device_constructors()
        except (ImportError, AttributeError):  # another torch: nothing cached to build
            pass
        for name, kind in CREATION_FUNCTIONS:
            original = getattr(torch, name)
            wrapper = self._creation_wrapper(original, name, kind)
            setattr(torch, name, wrapper)
            _script_as_builtin(wrapper, original)


    def _creation_wrapper(self, original: Any, name: str, kind: str | None) -> Any:
        backend = self.backend

        @functools.wraps(original)
        def make(data: Any, *args: Any, **kwargs: Any) -> Any:
            if backend.disabled or backend.paused or isinstance(data, torch.Tensor):
                return original(data, *args, **kwargs)
            entry_kind = kind or ("numpy" if isinstance(data, (np.ndarray, np.generic))
                                  else "python_value")
            recorder = backend.recorder
            outer, recorder.creating = recorder.creating, (entry_kind, f"torch.{name}")
            try:
                result = original(data, *args, **kwargs)
            finally:
                recorder.creating = outer
            if isinstance(result, torch.Tensor) and outer is None:
                with backend.guarded():
                    self._note_entry(result, entry_kind, f"torch.{name}")
            return result

        return make

    def _note_entry(self, t: torch.Tensor, kind: str, what: str) -> None:
        """A tensor made from outside data: an entry point, and data of this step if made by
        the training loop itself (inside a module, a backward or a custom op's own code it
        is part of the computation, not data)."""
        backend = self.backend
        recorder = backend.recorder
        if recorder.depth > 0:
            return
        source = backend.session.sources.here(2)
        with backend.paused_capture():
            fp = recorder.known(t)
            if fp is None:
                fp = recorder.remember(t, recorder.fingerprint(t))
                if recorder.window:
                    recorder.add(Kind.ENTRY, int(backend.phase), 0,
                                 backend.session.intern(f"{kind}:{what}"),
                                 backend.current_module(), source, [fp], [], [], (), t.numel(),
                                 [t])
        if not backend.module_stack and backend.phase in (Phase.INIT, Phase.DATA,
                                                          Phase.FORWARD):
            entry = backend.data_entry(self._label(f"{kind}:{what}", source), [fp], t.numel())
            # memory nobody reads is no evidence (MONAI's dtype lookup over np.empty)
            entry.watcher = unread.watch(t, sys._getframe(2), lambda: _mark_unread(entry))

    def _loader_index(self, loader: Any) -> int:
        index = self.loaders.get(loader)
        if index is None:
            index = self.loaders[loader] = len(self.loaders)
            self.backend.session.send_facts({f"dataloader#{index}": {
                "loader.num_workers": int(getattr(loader, "num_workers", 0)),
                "loader.in_order": bool(getattr(loader, "in_order", True)),
                "loader.has_generator": getattr(loader, "generator", None) is not None,
                "loader.has_worker_init_fn": getattr(loader, "worker_init_fn", None) is not None,
                "loader.persistent_workers": bool(getattr(loader, "persistent_workers", False)),
                "loader.sampler": type(getattr(loader, "sampler", None)).__name__,
            }})
        return index

    def _record_batch(self, iterator: Any, batch: Any) -> None:
        backend = self.backend
        index = self.loader_of_iter.get(iterator, 0)
        tensors = list(leaf_tensors(batch))
        recorder = backend.recorder
        name = f"dataloader:batch from DataLoader#{index}"
        source = backend.session.sources.here(2)
        numel = tensors[0].numel() if tensors else 0
        with backend.paused_capture():
            fps = []
            for t in tensors:
                fp = recorder.known(t) or recorder.remember(t, recorder.fingerprint(t))
                fps.append(fp)
            if recorder.window:
                recorder.add(Kind.ENTRY, int(Phase.DATA), 0, backend.session.intern(name), -1,
                             source, fps, [], [], (), numel, tensors)
        backend.add_data(self._label(name, source), fps, numel)

    def _label(self, name: str, source: int) -> str:
        """How a data entry is named in the step-level rows: "kind:what @ file:line"."""
        where = self.backend.session.string(source)
        return f"{name} @ {where}" if where else name


def _mark_unread(entry: DataEntry) -> None:
    entry.unread = True


def _script_as_builtin(wrapper: Any, original: Any) -> None:
    """TorchScript compiles ``torch.tensor(...)`` in scripted code as the aten op it finds
    for that object, by identity, in a table built once from the torch.* attributes. Built
    before the wrappers (torch's own imports may build it), it did not know them and tried
    to compile the wrapper as Python source: ``import torch.distributed.optim`` (pytorch-
    ignite, ZeroRedundancyOptimizer) raised a TypeError in the user's script under nondet.
    Built later, it holds the wrappers already."""
    try:
        from torch.jit import _builtins

        table = _builtins._builtin_table
        if table is not None and id(original) in table:
            table[id(wrapper)] = table[id(original)]
    except (ImportError, AttributeError):  # another torch: no such table
        pass
