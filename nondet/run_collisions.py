"""Failures that come from running the two runs side by side, not from the script.

Both runs of a pair share the script's working directory and run at the same time
(lockstep). A few libraries refuse a second writer of a file there: TensorFlow's
``Dataset.cache(filename)`` takes a lockfile while it writes the cache, and the other run's
iterator fails with "There appears to be a concurrent caching iterator running". Run alone,
the script works: reporting "the script failed" would blame it for nondet's own set-up.
``collision`` turns such a log into the one line to show instead (exit 2 still: nondet could
not compare the runs, and the user must change how the cache is made).
"""

from __future__ import annotations

import os
import re

from nondet import outdir

# TF 2.x: core/kernels/data/cache_dataset_ops.cc ("...cache lockfile already exists ('X').")
_TF_CACHE_LOCK = re.compile(
    r"concurrent caching iterator running - cache lockfile already exists \('([^']*)'\)")


#: A socket bound to a port already taken (torch.distributed's store, a server the script
#: starts): the DDP tutorial's ``mp.spawn`` with a fixed ``MASTER_PORT`` in both runs at once.
_PORT_IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
_PORT = re.compile(r"port:? (\d+)")


def collision(log: str) -> str | None:
    """The message for a run that failed on the twin run's file or port, or None."""
    if _PORT_IN_USE.search(log):
        port = _PORT.search(log)
        which = f" ({port.group(1)})" if port else ""
        return (f"a network port the script listens on{which} was in use: nondet runs the two "
                "runs at once, and both bind the script's fixed port (MASTER_PORT, a server's "
                "port). Run nondet with --schedule sequential (one run after the other), or "
                "let each run take a free port")
    match = _TF_CACHE_LOCK.search(log)
    if match is None:
        return None
    lockfile = match.group(1)
    prefix = re.sub(r"_\d+\.lockfile$", "", lockfile)
    return (f"both runs write the tf.data cache '{prefix}' (Dataset.cache(filename)) in the "
            f"working directory they share, and TensorFlow refuses a second writer (lockfile "
            f"'{lockfile}'): nondet runs the two at once. Run the script once without nondet "
            f"to build the cache (both runs then only read it), run nondet with --schedule "
            f"sequential (one run after the other), give .cache() a file per run, or cache in "
            f"memory (.cache() without a file name)")


#: Entries looked at, at most, for files written while the runs ran (``written_since``).
SCAN_BUDGET = 5000
#: Directories never looked into: hidden ones (``.nondet``, ``.git``), installs, and any that
#: holds an invocation of nondet's (``_nondets``).
_SKIPPED = frozenset({"site-packages", "dist-packages", "__pycache__", "node_modules"})


def written_since(root: str, since: float, most: int = 3) -> list[str]:
    """Up to ``most`` files under ``root`` (relative paths, newest first) last written at or
    after ``since`` (real time), from a walk of at most ``SCAN_BUDGET`` entries that skips
    hidden directories, installed packages and nondet's own output (its folders, the file
    its standard output goes to). Never raises."""
    found: list[tuple[float, str]] = []
    pending, seen = [root], 0
    own = _own_outputs()
    while pending and seen < SCAN_BUDGET:
        folder = pending.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    seen += 1
                    if seen > SCAN_BUDGET:
                        break
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            if not entry.name.startswith(".") and entry.name not in _SKIPPED \
                                    and not _nondets(entry.path):
                                pending.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            st = entry.stat(follow_symlinks=False)
                            if st.st_mtime >= since and (st.st_dev, st.st_ino) not in own:
                                found.append((st.st_mtime, os.path.relpath(entry.path, root)))
                    except OSError:
                        continue
        except OSError:
            continue
    return [path for _, path in sorted(found, reverse=True)[:most]]


def _own_outputs() -> set[tuple[int, int]]:
    """(device, inode) of the files nondet's own standard streams write to (`nondet run ...
    > out.txt`, `| tee log` writes through a pipe): what nondet wrote, not the script."""
    own = set()
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        own.add((st.st_dev, st.st_ino))
    return own


def _nondets(folder: str) -> bool:
    """A folder nondet made (an invocation's, ``--out results``): never the script's files."""
    return os.path.exists(os.path.join(folder, outdir.MARKER))


def side_by_side_hint(files: list[str]) -> str:
    """What to add to "the script failed in run X" when it failed in one run of a lockstep
    pair only, and the runs wrote ``files`` into the working directory they share: a run
    may have read what its twin was writing (shards rewritten at every start, a file
    truncated and filled again), which no run alone ever does."""
    if not files:
        return ""
    return (f"; it failed in that run only, and the two runs, which nondet ran at once in "
            f"the same working directory, wrote files there as they ran ({', '.join(files)}): "
            "if the script works when run alone, one run may have read a file the other was "
            "writing; run nondet with --schedule sequential (one run after the other), or have "
            "each run write files of its own")
