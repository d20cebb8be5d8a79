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

import re

# TF 2.x: core/kernels/data/cache_dataset_ops.cc ("...cache lockfile already exists ('X').")
_TF_CACHE_LOCK = re.compile(
    r"concurrent caching iterator running - cache lockfile already exists \('([^']*)'\)")


def collision(log: str) -> str | None:
    """The message for a run that failed on the twin run's file, or None."""
    match = _TF_CACHE_LOCK.search(log)
    if match is None:
        return None
    lockfile = match.group(1)
    prefix = re.sub(r"_\d+\.lockfile$", "", lockfile)
    return (f"both runs write the tf.data cache '{prefix}' (Dataset.cache(filename)) in the "
            f"working directory they share, and TensorFlow refuses a second writer (lockfile "
            f"'{lockfile}'): nondet runs the two at once. Run the script once without nondet "
            f"to build the cache (both runs then only read it), or give .cache() a file per "
            f"run, or cache in memory (.cache() without a file name)")
