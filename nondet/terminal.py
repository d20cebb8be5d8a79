"""The controlling terminal's settings, put back as they were when nondet ends.

Both runs of a script start at once and share nondet's controlling terminal. A script that
prompts there (``getpass.getpass``, a token prompt) turns echo off and back on in each run;
interleaved, the run that restores last puts back the settings the other had changed, and
the user's shell was left with echo off after nondet exited, on a normal end as after
Ctrl-C (faults round 12). nondet reads the settings once at its start and, if they differ
at its end, writes them back. Only while nondet is in the terminal's foreground process
group: from the background, writing them would stop nondet (``SIGTTOU``). Never raises.
"""

from __future__ import annotations

import os
import termios
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def settings_kept() -> Iterator[None]:
    """Put the controlling terminal's settings back on the way out, if they changed."""
    fd, saved = _open_and_read()
    try:
        yield
    finally:
        if fd is not None:
            _restore(fd, saved)
            os.close(fd)


def _open_and_read() -> tuple[int | None, Any]:
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None, None  # no controlling terminal (CI, cron, a pipe): nothing to keep
    try:
        return fd, termios.tcgetattr(fd)
    except (termios.error, OSError):
        os.close(fd)
        return None, None


def _restore(fd: int, saved: Any) -> None:
    try:
        if os.tcgetpgrp(fd) != os.getpgrp() or termios.tcgetattr(fd) == saved:
            return
        termios.tcsetattr(fd, termios.TCSANOW, saved)  # no wait for output to drain
    except (OSError, termios.error):
        pass  # the terminal went away: nothing to put back
