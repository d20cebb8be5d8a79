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

Note [State made on another thread]
A model or optimizer first seen on a thread other than the owner while the owner runs
(a second training thread setting up, the main thread building the next model while a
worker trains) is made at a point in the owner's steps set by thread timing. Counted in
the owner's step rows from then on, the same script's rows would differ between runs (a
false alarm: "params differ" at whichever step it joined in one run and not the other).
So the backends hold such state aside (``foreign``) and let it join the step state only
when the step count changes owner (``changes``), a point in the step sequence that thread
timing does not move: the owner's steps are all over by then.
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
        #: how many times the step count changed owner (Note [State made on another thread])
        self.changes = 0

    def check(self) -> str:
        """"" if the calling thread may end a step, else why not (the same text from then
        on, in every thread: the run is being stopped)."""
        if self.clash:
            return self.clash
        me = threading.current_thread()
        owner = self._owner
        if owner is None or owner is me or not owner.is_alive():
            if owner is not None and owner is not me:
                self.changes += 1
            self._owner = me
            return ""
        self.clash = (f"the script trains in two threads at once ({owner.name!r} and "
                      f"{me.name!r}): their steps interleave by thread timing, so nondet "
                      "cannot number them alike in two runs; train the models one after the "
                      "other, or each in a process of its own")
        return self.clash

    def foreign(self) -> bool:
        """True if another thread owns the step count and still runs: what the calling
        thread makes now is held out of the step state (Note [State made on another
        thread])."""
        owner = self._owner
        return owner is not None and owner is not threading.current_thread() \
            and owner.is_alive()

    def owned(self) -> bool:
        """True if the calling thread owns the step count."""
        return self._owner is threading.current_thread()

    def handing_over(self) -> bool:
        """True if the calling thread's next step end takes the step count over from an
        owner that has ended (or already did: ``changes`` tells which)."""
        owner = self._owner
        return owner is not None and owner is not threading.current_thread() \
            and not owner.is_alive()

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
