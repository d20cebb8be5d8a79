"""Reading an untrusted capture first in a short-lived child process.

Checksums catch damaged data, but a damaged or crafted file can still send libhdf5 itself
into a crash (a segfault in the C library) or an endless loop (seen on byte-flipped format
1.0 files, which have no metadata checksums) before any check of ours runs, and neither
can be caught in-process. So a file is first opened and read completely (``verify``) in a
forked child with a deadline; only if that child succeeds does the caller read it. Files
this process wrote itself, unchanged since, are trusted and skip the probe.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nondet import paused, settings
from nondet.errors import NondetError

#: Seconds a probe may take before the file is called unreadable (plus 1 s per 20 MB);
#: None: ``NONDET_PROBE_SECONDS`` (nondet.settings), read when a file is probed
PROBE_SECONDS: float | None = None

_WRITTEN: dict[str, tuple[int, int, int]] = {}  # path -> (inode, size, mtime) at close


def _identity(path: Path) -> tuple[str, tuple[int, int, int]] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return str(path.resolve()), (st.st_ino, st.st_size, st.st_mtime_ns)


def remember_written(path: Path) -> None:
    """Called by the writer when it closes a file: this process made it."""
    found = _identity(path)
    if found is not None:
        _WRITTEN[found[0]] = found[1]


def trusted(path: Path) -> bool:
    found = _identity(path)
    return found is not None and _WRITTEN.get(found[0]) == found[1]


def probe(path: Path, read: Callable[[Path], None]) -> bool:
    """Run ``read(path)`` in a forked child; raise NondetError if it fails, crashes or hangs.
    True if the child read the file without trouble.

    An unexpected exception in the child (a bug in nondet, not the file) is not judged
    here: the caller's own read will raise it again, with its traceback.
    """
    size = path.stat().st_size
    seconds = (PROBE_SECONDS or settings.seconds("NONDET_PROBE_SECONDS")) + size / 20e6
    if not hasattr(os, "fork") or threading.active_count() > 1:
        # Another thread might hold a lock the child needs (h5py's): a fresh interpreter.
        return _probe_in_new_process(path, seconds)
    started = time.monotonic()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        _quiet()  # a crash is reported by the parent, in one line
        code, message = 0, b""
        try:
            read(path)
        except NondetError as exc:
            code, message = 2, str(exc).encode("utf-8", errors="replace")
        except BaseException:
            code = 3
        try:
            os.write(w, message[:8000])
        finally:
            os._exit(code)
    os.close(w)
    try:
        status = _wait(pid, started, seconds)
        with os.fdopen(r, "rb") as pipe:
            said = pipe.read().decode("utf-8", errors="replace")
    except BaseException:
        _kill(pid)
        raise
    if status is None:
        return _judge(path, seconds, None, "")
    return _judge(path, seconds, os.waitstatus_to_exitcode(status), said)


def _judge(path: Path, seconds: float, code: int | None, said: str) -> bool:
    """The probe's verdict from the child's exit code (negative: a signal; None: killed at
    the deadline) and what it said."""
    if code is None:
        if os.environ.get("NONDET_PROBE_SECONDS", "").strip():  # the user's limit, not ours
            raise NondetError(f"cannot read {path}: reading it did not finish within "
                              f"{seconds:.3g} s, the limit NONDET_PROBE_SECONDS sets; raise "
                              "it or unset it (if it still does not finish, the capture is "
                              "damaged: re-capture it with `nondet run`)")
        raise NondetError(f"cannot read {path}: damaged capture (reading it did not finish "
                          f"within {seconds:.0f} s); re-capture it with `nondet run`")
    if code < 0:
        name = signal.Signals(-code).name
        raise NondetError(f"cannot read {path}: damaged capture (the HDF5 library crashed "
                          f"reading it: {name}); re-capture it with `nondet run`")
    if code == 2:
        raise NondetError(said.strip() or f"cannot read {path}: damaged capture")
    return code == 0


def _probe_in_new_process(path: Path, seconds: float) -> bool:
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-m", "nondet.store.probe", str(path)],
                              capture_output=True, timeout=seconds, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:  # run() has killed it
        return _judge(path, seconds, None, "")
    return _judge(path, seconds, done.returncode, done.stdout.decode(errors="replace"))


def main(argv: list[str]) -> int:
    """``python -m nondet.store.probe PATH``: exit 0 if the capture reads, 2 with the reason."""
    from nondet.store.reader import _read_all

    try:
        _read_all(Path(argv[0]))
    except NondetError as exc:
        print(str(exc))
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))


def _quiet() -> None:
    import faulthandler

    faulthandler.disable()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _wait(pid: int, started: float, seconds: float) -> int | None:
    """The child's wait status, or None after killing it ``seconds`` after ``started``
    (or after nondet last resumed from a pause: ``nondet.paused``)."""
    delay = 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > paused.since(started) + seconds:
            _kill(pid)
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
