"""Child side: a run whose nondet is gone ends itself.

nondet ends its runs when it is interrupted or terminated, and a run stops at its next step
boundary once it finds the pipe to nondet closed (``Session``). SIGKILL to nondet (the
out-of-memory killer's choice, a CI job's hard timeout) can be handled by no process, and a
run that never reaches another step boundary (a loop that no longer trains, a long
evaluation) kept running under init: a trial found one still running 12 minutes later.
Nobody records such a run any more, so a thread checks every ``CHECK_SECONDS`` whether the
process that started the run is still its parent, and when it is not, sends SIGKILL to the
run's processes (``own_group.run_processes``: the run and its descendants in its group),
the run's own process last.
"""

from __future__ import annotations

import os
import signal
import time

from nondet import own_group, own_os, own_threads

CHECK_SECONDS = 1.0


def watch(interval: float = CHECK_SECONDS) -> None:
    """Start the check in this process (a forked copy has no such thread: its parent is
    the run, whose end it follows as its own script would have it)."""
    parent, root, group = own_os.getppid(), own_os.getpid(), os.getpgrp()

    def loop() -> None:
        while own_os.getpid() == root:
            time.sleep(interval)
            if own_os.getppid() != parent:
                for pid in [p for p in own_group.run_processes(root, group) if p != root]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass  # ended meanwhile, or not ours to signal
                os.kill(root, signal.SIGKILL)

    own_threads.start(loop)  # Note [Threads the script cannot see] in own_threads.py
