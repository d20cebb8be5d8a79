"""SIGCHLD ignored by whoever started nondet (a daemon or launcher that sets it to SIG_IGN
and execs; the disposition is inherited across exec).

With SIGCHLD ignored the kernel reaps children at once, and ``waitpid`` fails with ECHILD,
which Python's ``subprocess`` reads as exit status 0: a run that aborted (SIGABRT) or
ended with ``os._exit(3)`` counted as a clean end, and a crashing script got
"deterministic", exit 0. nondet's own process waits for its runs with the default
disposition; the script is given back the one it was started with, so it behaves in the
run as it would under ``python`` (where its own ``subprocess`` calls see the same ECHILD).
"""

from __future__ import annotations

import os
import signal

#: Set in nondet's environment (so every run inherits it) when SIGCHLD was ignored.
IGNORED_ENV = "NONDET_SIGCHLD_IGNORED"


def reap_own_children() -> None:
    """nondet's process (the CLI): wait for its runs with SIGCHLD at its default."""
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ[IGNORED_ENV] = "1"


def as_started() -> None:
    """A run, just before the script: SIGCHLD as nondet was started with it."""
    if os.environ.pop(IGNORED_ENV, None) == "1":
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
