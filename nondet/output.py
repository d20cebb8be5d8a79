"""A run's output (its stdout and stderr, one pipe): read into its log until the run is
over, then drained in the background for as long as a process it left running holds it.

A process the script started (a server, a logger, a daemon) may outlive it with the pipe
open, so end-of-file may never come. Once the run's own process has ended, its output is
complete when the pipe has been quiet for ``QUIET`` seconds, or ``AFTER_EXIT`` seconds
after the exit whatever is still written (a process that prints for good must not hold
the run's end). The pipe is not dropped then: a process that went on printing would block
once the pipe buffer (64 KiB) is full, for as long as nondet runs (it verifies fixes for
minutes). ``drain`` reads on, appending to the log up to ``LEFT_MAX`` bytes, until
end-of-file or nondet's exit (after which that process gets EPIPE, as from a closed
terminal).
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, BinaryIO

#: seconds without output, after the run's process has ended, that end its output
QUIET = 1.0
#: seconds after the run's process ended after which its output is over, quiet or not
AFTER_EXIT = 5.0
#: bytes that processes the run left running may still add to its log
LEFT_MAX = 64 << 20


def pump(stream: IO[bytes], ended: Callable[[], bool], store: Callable[[bytes], None],
         echo: Callable[[bytes], None] | None, log_path: Path) -> None:
    """Read ``stream`` into ``store`` (and whole lines into ``echo``) until the run is over
    (``ended``: its process has exited), then leave the rest to ``drain``."""
    fd = stream.fileno()
    pending = b""  # a line not yet ended, for the echo's prefix
    quiet_since: float | None = None
    exited_at: float | None = None
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        now = time.monotonic()
        if ready:
            data = os.read(fd, 1 << 16)
            if not data:
                stream.close()
                break  # every writer is gone: nothing left to drain
            quiet_since = None
            store(data)
            if echo is not None:
                *lines, pending = (pending + data).split(b"\n")
                echo(b"".join(line + b"\n" for line in lines))
        elif exited_at is not None:
            quiet_since = quiet_since or now
        if exited_at is None and ended():
            exited_at = now
        if exited_at is not None and (
                (quiet_since is not None and now - quiet_since > QUIET)
                or now - exited_at > AFTER_EXIT):
            drain(stream, log_path)
            break
    if echo is not None and pending:
        echo(pending + b"\n")


def drain(stream: IO[bytes], log_path: Path, limit: int = LEFT_MAX) -> threading.Thread:
    """Read ``stream`` to its end in a daemon thread, appending up to ``limit`` bytes to
    ``log_path``; the rest is read and dropped. The thread owns ``stream`` (and closes it)."""

    def run() -> None:
        room = limit
        try:
            log: BinaryIO | None = open(log_path, "ab")  # noqa: SIM115 - closed below
        except OSError:
            log = None
        try:
            while data := os.read(stream.fileno(), 1 << 16):
                if log is not None and room > 0:
                    try:
                        log.write(data[:room])
                        log.flush()
                    except OSError:  # disk full: the run's log keeps what it has
                        log.close()
                        log = None
                    room -= len(data)
        except OSError:
            pass
        finally:
            if log is not None:
                log.close()
            stream.close()

    thread = threading.Thread(target=run, name="nondet-drain", daemon=True)
    thread.start()
    return thread
