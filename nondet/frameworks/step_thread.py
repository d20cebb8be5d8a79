"""Which thread's steps are counted: one at a time.

Steps are numbered in the order their boundaries (optimizer updates, backward passes) are
reached. Two threads that train at once (one model each, an ensemble in a thread pool)
reach them in an order set by thread timing, different in every run, and each step's row
would mix what both threads did: a false difference at the first step, and two threads
waiting for lockstep turns on one control pipe (a hang). So the first thread that ends a
step owns the step count until it ends; another thread may take over only then (training
in a background thread, then fine-tuning in the main one). A boundary reached by a second
thread while the owner still runs is a clash: the run is stopped and reported as
something nondet cannot record (exit 2), never compared.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from nondet import channel


class StepThread:
    """The thread that owns the step count, and the clash once one happened (sticky)."""

    def __init__(self) -> None:
        self._owner: threading.Thread | None = None
        self.clash = ""
        self.reported = False  # the clash was sent to the parent

    def check(self) -> str:
        """"" if the calling thread may end a step, else why not (the same text from then
        on, in every thread: the run is being stopped)."""
        if self.clash:
            return self.clash
        me = threading.current_thread()
        owner = self._owner
        if owner is None or owner is me or not owner.is_alive():
            self._owner = me
            return ""
        self.clash = (f"the script trains in two threads at once ({owner.name!r} and "
                      f"{me.name!r}): their steps interleave by thread timing, so nondet "
                      "cannot number them alike in two runs; train the models one after the "
                      "other, or each in a process of its own")
        return self.clash

    def clashed(self, send_meta: Callable[[dict[str, Any]], None]) -> bool:
        """True if the calling thread may not end a step: the run must stop, never be
        compared; the parent is told why once (``channel.META_UNSUPPORTED``)."""
        clash = self.check()
        if clash and not self.reported:
            self.reported = True
            send_meta({channel.META_UNSUPPORTED: clash})
        return bool(clash)


#: The thread whose steps are counted (one per process, shared by the backends).
STEP_THREAD = StepThread()
