"""A Keras ``PyDataset`` whose ``__getitem__`` draws from a generator every call shares.

With ``workers > 1`` Keras runs ``__getitem__`` in a pool. A generator the calls share
(``self.rng = np.random.default_rng(0)`` made in ``__init__``; NumPy's or Python's global one)
is consumed in the order the workers reach it, so which batch gets which draws depends on
scheduling. With threads the draws of two batches interleave and the runs nearly always
differ; with processes (``use_multiprocessing=True``) each forked worker draws from its own
copy, so a batch's values depend only on which worker took it and how many it took before:
the runs differ only when that assignment does (2 outcomes in 10 plain runs of
FINDINGS' script), so two runs often agree and the race goes unseen.

``SharedDraws`` wraps Keras' ``get_index`` (what the pool runs for each batch, in a worker
thread or a forked process) to compare the states of those generators before and after the
call: a call that moved one drew from shared state. A forked worker cannot write to the
run's pipe, so the worker marks it in a page of anonymous shared memory made before the pool
forks; the run reads the page at each step's and epoch's end and adds a capture note, shown
with every report (a deterministic one too). Nothing here changes what the call returns, and nothing
raises into the worker: any trouble only leaves the page unmarked.
"""

from __future__ import annotations

import functools
import mmap
import pickle
import random
from collections.abc import Callable
from typing import Any

from nondet import own_os

#: Capture note key (``capture_note.<key>``).
NOTE_KEY = "keras_pydataset_shared_draws"

NOTE = (
    "the Keras PyDataset's __getitem__ at {source} drew from {what}, which every call shares, "
    "while {workers} worker {kind} ran it: which batch gets which draws depends on which "
    "worker reaches it first, so its batches can differ between runs even when two runs "
    "agree; make a generator per batch in __getitem__ (np.random.default_rng(seed + index)) "
    "or read it with workers=1")

#: Bytes of the shared page: a mark, then the name of what moved (utf-8, NUL-padded).
_PAGE = 256


class SharedDraws:
    """Watches one run's PyDataset calls (installed once, by ``data.PipelineSettings``)."""

    def __init__(self) -> None:
        self._page: mmap.mmap | None = None  # made by ``arm``, before a pool forks
        self._parent = own_os.getpid()
        # odd while the dataset's own on_epoch_begin/on_epoch_end run (in the main thread,
        # while worker threads may still call __getitem__): a generator they move is
        # not __getitem__'s draw, so a call that overlaps one counts for nothing
        self.epoch_hooks = 0

    @property
    def armed(self) -> bool:
        return self._page is not None

    def arm(self) -> None:
        """Make the shared page (a PyDataset with workers is about to be read)."""
        if self._page is None:
            self._page = mmap.mmap(-1, _PAGE)  # MAP_SHARED | MAP_ANONYMOUS: forks share it

    def wrap(self, get_index: Callable[[Any, Any], Any], sequences: Callable[[], Any]
             ) -> Callable[[Any, Any], Any]:
        """Keras' ``get_index(uid, i)`` with the check around it. ``sequences`` returns the
        module's ``_SHARED_SEQUENCES`` as the calling worker sees it."""
        watch = self

        @functools.wraps(get_index)  # same name and module: the pool pickles it by name
        def checked(uid: Any, i: Any) -> Any:
            if watch._page is None or watch._page[0]:
                return get_index(uid, i)  # not armed, or already seen: nothing to learn
            dataset, before, hooks = None, {}, watch.epoch_hooks
            try:
                dataset = sequences()[uid]
                before = watch._states(dataset)
            except Exception:
                pass
            result = get_index(uid, i)
            if before and (watch._forked() or (hooks % 2 == 0 and watch.epoch_hooks == hooks)):
                try:
                    watch._compare(before, watch._states(dataset))
                except Exception:
                    pass
            return result

        return checked

    def _forked(self) -> bool:
        # The dataset's epoch hooks run in the parent. Keras' enqueuer thread forks the pool
        # while the main thread may still be inside on_epoch_begin, so a worker's copy of
        # ``epoch_hooks`` can be odd for good; its generators are its own copies, which
        # the parent's hooks never move.
        return own_os.getpid() != self._parent

    def seen(self) -> str | None:
        """What a call moved ("self.rng", "NumPy's global generator"), if any did."""
        if self._page is None or not self._page[0]:
            return None
        return self._page[1:].rstrip(b"\0").decode("utf-8", "replace") or "a shared generator"

    # -- worker side ---------------------------------------------------------------------------
    def _states(self, dataset: Any) -> dict[str, bytes]:
        import numpy as np

        states: dict[str, bytes] = {}
        for name, value in vars(dataset).items():
            if isinstance(value, np.random.Generator):
                states[f"self.{name}"] = pickle.dumps(value.bit_generator.state)
            elif isinstance(value, np.random.RandomState):
                states[f"self.{name}"] = pickle.dumps(value.get_state())
            elif isinstance(value, random.Random):
                states[f"self.{name}"] = pickle.dumps(value.getstate())
        if self._forked():
            # a forked worker runs one call at a time and nothing else draws there; in a
            # thread the run's other threads may draw from the global generators meanwhile
            states["NumPy's global generator (np.random.*)"] = pickle.dumps(
                np.random.get_state())
            states["Python's global generator (random.*)"] = pickle.dumps(random.getstate())
        return states

    def _compare(self, before: dict[str, bytes], after: dict[str, bytes]) -> None:
        page = self._page
        moved = [name for name, state in before.items() if after.get(name) != state]
        if page is None or not moved:
            return
        name = moved[0].encode("utf-8")[: _PAGE - 1]
        page[1:1 + len(name)] = name
        page[0] = 1  # last: a reader that sees the mark sees the name
