"""Background threads nondet starts inside the script's process, out of the script's sight.

Note [Threads the script cannot see]
A ``threading.Thread`` is listed by ``threading.enumerate()`` and counted by
``threading.active_count()``. Scripts use both: one asserted it had started no thread
("unexpected threads: nondet-fdwatch, nondet-orphan", the script failed under nondet only),
another waited for ``active_count() == 1`` or joined every thread but its own after
training, and waited for nondet's watchers, which never end, until the idle limit. nondet's
threads in the run (the closed-pipe watcher, the orphan check, the channel's flusher) are
started with ``_thread`` instead: not in threading's table, never joined, gone with the
process like daemon threads. Their code must not call ``threading.current_thread()``
(directly or through ``logging``), which would enter them in the table after all.
"""

from __future__ import annotations

import _thread
from collections.abc import Callable


def start(target: Callable[[], None]) -> None:
    """Run ``target`` in a background thread the script does not see (see the Note).
    An exception in it ends the thread quietly: nondet's own threads never write into the
    script's output. Raises what ``_thread.start_new_thread`` raises (no thread could be
    started)."""

    def run() -> None:
        try:
            target()
        except BaseException:  # the script's output is not nondet's to write in
            pass

    _thread.start_new_thread(run, ())
