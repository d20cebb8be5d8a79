"""Files a run reads that an earlier run of the same nondet invocation wrote.

nondet's runs share the script's working directory (scripts read data by relative paths).
A script that resumes from what it finds there (``if os.path.exists("ckpt.pt"):
torch.load(...)``, a cache it builds once, HF ``resume_from_checkpoint``) starts nondet's
later runs (narrowing, verification) from what the first pair left: the runs no longer
start from the same state, and nothing in the tensors says why. This module notes each
such file once, as a ``capture_note`` fact the report shows (``analysis.capture_notes``).

The test, per open for reading of a path under the working directory: its mtime lies
between the invocation's start (``NONDET_INVOCATION_STARTED``, real time, set by the
parent) and this run's start. Files written before nondet started (the data) are older;
files this run writes itself are newer. Overhead: one ``os.stat`` per open for reading,
nothing per step.

The pair's race (both runs at once: the first builds ``cache.npy`` if missing, the other
loads it): a file newer than this run's start that this run had not opened for writing is
listed (``FRESH_FACT``), and so is every path it opens for writing (``WROTE_FACT``). The
parent names a file one run read and the twin opened for writing (``pair_notes``). A file
newer than the run may also be its own, written in C (torch.save, safetensors, h5py never
call ``open``): it is named only when the twin's ``open`` wrote it, which the same script
in the reading run would have done through ``open`` too, so never a false note.
"""

from __future__ import annotations

import builtins
import functools
import io
import os
import stat
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nondet import session as session_module
from nondet.session import Session

if TYPE_CHECKING:
    from nondet.store import Capture

#: Environment variable: the wall-clock time (``time.time()``) the nondet invocation began.
STARTED_ENV = "NONDET_INVOCATION_STARTED"
#: Fact key prefix (under ``capture_note.``) of one file read back.
FACT = "read_earlier_run_output"
#: Files named at most (a script reading a whole directory back is named by its first ones).
MAX_FILES = 8
#: Facts for the pair's race (``pair_notes``): paths under the cwd this run opened for
#: writing, and paths it read that were written while it ran, by others than its own opens.
WROTE_FACT = "readback.wrote"
FRESH_FACT = "readback.read_fresh"
MAX_PAIR_FILES = 64
#: Fact: tf.data cache files (``Dataset.cache(filename)``, by prefix) this run was to use
#: that did not exist when it started or were written since (``pair_notes``).
CACHE_FACT = "readback.tf_cache"
#: nondet's own output directory (the captures): never the script's state.
_OWN_DIR = ".nondet"
# mtime granularity: on a file system keeping whole seconds, a file written in the second
# the invocation started still counts
_SLACK = 1.0

#: Directories of installed packages (any environment's): never the script's state.
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})

#: Paths remembered as checked (a script reading a million files does not grow it further).
_CHECKED_MAX = 100_000

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

#: The installed run's watches of files frameworks read in C, which framework hooks report
#: (``file_read``, ``cache_file``); None outside a run started by a nondet parent.
_READ_WATCH: Callable[[str], None] | None = None
_CACHE_WATCH: Callable[[str], None] | None = None


def file_read(path: str) -> None:
    """The script reads ``path`` in C (a TensorFlow checkpoint, a Keras ``.weights.h5``):
    checked as an ``open`` for reading would be. Never raises."""
    if _READ_WATCH is not None:
        _READ_WATCH(path)


def cache_file(prefix: str) -> None:
    """A ``tf.data`` cache at ``prefix`` (``Dataset.cache(filename)``) is to be used: TensorFlow
    reads a finished one (``prefix.index``) in C, never through ``open``. Never raises."""
    if _CACHE_WATCH is not None:
        _CACHE_WATCH(prefix)


def note_text(path: str) -> str:
    """The note for one file read back (the report's wording)."""
    return (f"a run read {path}, written by an earlier run of this nondet invocation: the "
            "runs did not start from the same state (the script resumes from or reuses "
            "what it finds), so where they part and whether a fix holds may be wrong; "
            "delete it before running nondet, or point the script's output elsewhere")


def install(session: Session, run_started: float | None = None) -> None:
    """Watch the script's opens for reading (``open``/``io.open``/``os.open``; ``np.load``,
    ``torch.load`` and ``pickle`` of a path go through them). Call before the clock shift:
    ``run_started`` is real time."""
    try:
        invocation = float(os.environ[STARTED_ENV])
    except (KeyError, ValueError):
        return  # not started by a nondet parent that says when (an old one, a test)
    started = time.time() if run_started is None else run_started
    cwd = os.path.abspath(os.getcwd()) + os.sep
    # the Python environment (a venv inside the project): installed packages, never the
    # script's state; `pip install` just before nondet left fresh metadata there
    installed = tuple({os.path.abspath(p) + os.sep
                       for p in (sys.prefix, sys.exec_prefix, sys.base_prefix)})
    seen: set[str] = set()
    checked: set[str] = set()
    wrote: list[str] = []  # the twin's race (pair_notes): what this run opened for writing
    fresh: list[str] = []  # and what it read that someone else wrote while it ran

    def note_write(file: Any) -> None:
        if len(wrote) >= MAX_PAIR_FILES or session_module.current() is not session:
            return
        try:
            shown = _shown(file, cwd)
            if shown is not None and shown not in wrote:
                wrote.append(shown)
                session.send_facts({WROTE_FACT: list(wrote)})
        except Exception:
            pass  # a hook never raises into the script

    def check(file: Any, reading: bool) -> None:
        if not reading:
            note_write(file)
            return
        if len(seen) >= MAX_FILES or session_module.current() is not session:
            return
        try:
            if isinstance(file, int) or not isinstance(file, (str, bytes, os.PathLike)):
                return
            path = os.fsdecode(file)
            real = os.path.abspath(path)  # no syscalls: a symlink into the cwd is missed
            if real in checked or not real.startswith(cwd):
                return
            if len(checked) < _CHECKED_MAX:
                # once checked, never again: a file's mtime only moves on, past this run's
                # start, so a file that was not another run's output cannot become one
                checked.add(real)
            shown = real[len(cwd):]
            parts = shown.split(os.sep)
            if (parts[0] == _OWN_DIR or real.startswith(installed)
                    or not _PACKAGE_DIRS.isdisjoint(parts)):
                return
            st = os.stat(real)
            mtime = st.st_mtime
            if not stat.S_ISREG(st.st_mode):
                return  # a directory listed (rmtree, BackupAndRestore's cleanup) is no read
            if _since(invocation, st) and mtime < started:
                seen.add(real)
                session.send_facts({f"capture_note.{FACT}:{shown}": note_text(shown)})
            elif mtime >= started and shown not in wrote and len(fresh) < MAX_PAIR_FILES:
                # written while this run went, not by its own opens: the twin's, or a C
                # writer's of its own (torch.save); pair_notes asks the twin which
                fresh.append(shown)
                session.send_facts({FRESH_FACT: list(fresh)})
        except Exception:
            pass  # a hook never raises into the script; an unreadable path is the script's

    cached: list[str] = []
    cache_seen: set[str] = set()

    def cache_watch(prefix: str) -> None:
        # Only a path's first cache of this run counts: a later one may read this run's own.
        if session_module.current() is not session or len(cache_seen) >= MAX_PAIR_FILES:
            return
        try:
            index = os.path.abspath(prefix) + ".index"
            shown = _shown(index, cwd)
            if shown is None or index in cache_seen:
                return
            cache_seen.add(index)
            check(index, True)  # an earlier run's cache: the read-back note
            try:
                fresh_file = os.stat(index).st_mtime >= started
            except OSError:
                fresh_file = True  # not there yet: this run or its twin will write it
            if fresh_file:
                cached.append(shown[:-len(".index")])
                session.send_facts({CACHE_FACT: list(cached)})
        except Exception:
            pass  # a hook never raises into the script

    global _CACHE_WATCH, _READ_WATCH
    _CACHE_WATCH = cache_watch
    _READ_WATCH = functools.partial(check, reading=True)

    original_open = builtins.open

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        opened = original_open(file, mode, *args, **kwargs)  # the script's errors stay its own
        check(file, isinstance(mode, str) and not any(c in mode for c in "wax"))
        return opened

    original_os_open = os.open

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = original_os_open(path, flags, *args, **kwargs)
        check(path, not flags & _WRITE_FLAGS)
        return fd

    builtins.open = open_
    io.open = open_
    os.open = os_open


def _since(invocation: float, st: os.stat_result) -> bool:
    """Whether a file was written at or after the invocation began. The slack is for file
    systems that keep whole seconds only (their mtime is rounded down); on one that keeps
    finer times, a file written a moment before nondet started (`cp train.py x.py && nondet
    run x.py`, the script a CI step just wrote) is older than the invocation, and counting
    it noted every run's own script as "written by an earlier run" (a false note)."""
    coarse = st.st_mtime_ns % 1_000_000_000 == 0
    return st.st_mtime >= invocation - (_SLACK if coarse else 0.0)


def _shown(file: Any, cwd: str) -> str | None:
    """A path under the working directory as the report shows it (None: elsewhere, a file
    descriptor, or nondet's own directory)."""
    if isinstance(file, int) or not isinstance(file, (str, bytes, os.PathLike)):
        return None
    real = os.path.abspath(os.fsdecode(file))
    if not real.startswith(cwd):
        return None
    shown = real[len(cwd):]
    return None if shown.split(os.sep, 1)[0] == _OWN_DIR else shown


# -- parent side ---------------------------------------------------------------------------
def pair_notes(a: Capture, b: Capture) -> list[str]:
    """A file one run of the pair read that the other run opened for writing while they both
    went (a cache built if missing, a checkpoint): the runs did not compute the same thing.
    Only files the reading run had not opened for writing itself before the read, and only
    writes made through ``open``/``os.open`` (a file both runs write in C is never named)."""
    notes = []
    for x, y in ((a, b), (b, a)):
        read, written = _paths(x.facts.get(FRESH_FACT)), _paths(y.facts.get(WROTE_FACT))
        for path in (p for p in read if p in written):
            notes.append(
                f"run {x.label} read {path}, which run {y.label} wrote while both ran: the "
                "runs share the working directory and one read what the other made (a cache "
                "built if missing, a checkpoint), so they did not compute the same thing and "
                "the verdict may hide a difference in how that file is made; delete it and "
                "build it before running nondet, or give each run a file of its own")
    theirs = _paths(b.facts.get(CACHE_FACT))
    for path in (p for p in _paths(a.facts.get(CACHE_FACT)) if p in theirs):
        notes.append(
            f"runs a and b both cached a tf.data pipeline to {path} (Dataset.cache), which "
            "neither found when it started: TensorFlow reads a finished cache instead of "
            "building it again, so the run that got there second trained on the data the "
            "other one cached, and the stages before the cache were not compared; delete "
            "the cache files and build them before running nondet, or cache in memory "
            "(Dataset.cache() without a file name) to compare them")
    return notes


def _paths(value: Any) -> list[str]:
    return [p for p in value if isinstance(p, str)] if isinstance(value, list) else []


def report_notes(capture_paths: list[str]) -> list[str]:
    """The read-back notes of the later runs' captures (narrowing, verification: the first
    pair's reach the report through ``analysis.capture_notes``), once each, and a warning
    when a fix's verification runs read such a file (their "verified" is not to be trusted)."""
    from nondet.store.reader import open_capture  # parent only: h5py stays out of the child

    notes: list[str] = []
    verification = False
    for path in capture_paths:
        if not path.endswith(".h5"):
            continue
        try:
            facts = open_capture(path).facts
        except Exception:
            continue  # a capture that cannot be read is reported by its own stage
        for key, value in facts.items():
            if key.startswith(f"capture_note.{FACT}:"):
                verification = verification or "-fix" in os.path.basename(path)
                if str(value) not in notes:
                    notes.append(str(value))
    if verification:
        notes.append("the runs that verified a fix read such a file too: they resumed from "
                     "another run's state, so \"verified\" above does not show the fix "
                     "works; delete the file and run nondet again")
    return notes
