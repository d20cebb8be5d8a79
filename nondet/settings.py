"""nondet's own settings from the environment (durations in seconds), checked once.

A mistyped value (``NONDET_IDLE_AFTER=10m``) is the user's to fix: one line naming the
variable, exit 2, before any run starts. Before, one was silently replaced by the default
(the idle limit) or crashed nondet (the probe's deadline), and a negative deadline called
every capture damaged.
"""

from __future__ import annotations

import math
import os

from nondet.errors import NondetError

#: variable -> default seconds (``inf``, where given, means never)
DURATIONS = {
    "NONDET_IDLE_AFTER": 600.0,  # a run idle this long is ended (nondet.idle)
    "NONDET_PROBE_SECONDS": 20.0,  # a capture not read within this is damaged (store.probe)
}


def seconds(name: str) -> float:
    """The duration ``name`` sets (its default when unset or empty)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return DURATIONS[name]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # NaN too
        raise NondetError(f"{name}={text!r} is not a duration: give a number of seconds "
                          f"greater than 0 (default {DURATIONS[name]:g}), or unset it")
    return value


def check() -> None:
    """Raise the one-line error for the first setting that is not valid."""
    for name in DURATIONS:
        seconds(name)
