"""Time nondet spent stopped is nobody's silence.

nondet's limits are measured on the monotonic clock, which goes on while a process is
stopped: Ctrl-Z and ``fg``, ``kill -STOP``/``-CONT``, a batch system suspending a job
(Slurm's ``scontrol suspend`` stops every process of it, then continues them). On
resuming, every quiet spell looked as long as the pause: a torchrun job stopped for
longer than its stall limit was ended as "ranks 0, 1 sent nothing for 135 s ... (a rank
hangs)", exit 2, blaming a healthy script; a run sleeping in a step was ended as idle; a
capture being read was called damaged ("reading it did not finish within 20 s").

The CLI records when it was last continued (SIGCONT, which the kernel sends on every
resume, whatever stopped the process); a limit counts from the later of its own start
and that moment (``since``). A pause of the runs alone (not of nondet) is theirs, and
still counts.
"""

from __future__ import annotations

import signal
import time

_RESUMED = float("-inf")  # time.monotonic() when nondet was last continued


def install() -> None:
    """Note every resume of this process (the CLI's main thread; elsewhere a no-op)."""
    try:
        signal.signal(signal.SIGCONT, _on_continue)
    except (ValueError, OSError, AttributeError):
        pass  # not the main thread (nondet used as a library), or no SIGCONT here


def _on_continue(signum: int, frame: object) -> None:
    global _RESUMED
    _RESUMED = time.monotonic()


def since(moment: float) -> float:
    """The later of ``moment`` (a ``time.monotonic()`` value) and nondet's last resume:
    where a quiet spell or a deadline counts from."""
    return max(moment, _RESUMED)


def resumed() -> float:
    """When nondet was last continued (``-inf`` if never)."""
    return _RESUMED
