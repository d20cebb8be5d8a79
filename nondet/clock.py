"""Run b's wall clock runs a few seconds ahead, so that a seed read from the clock differs.

The two runs start together, so ``int(time.time())`` often reads the same second in both
and a clock seed goes unnoticed about half the time. Run b (and the N-th run of
``--runs N``, N times as far) therefore sees the wall clock ``OFFSET_SECONDS`` ahead:
``time.time``, ``time.time_ns``, ``time.localtime``/``gmtime``/``ctime``/``strftime``
without a time, and ``datetime.now``/``utcnow``/``today`` (``date.today`` reads
``time.time``). Clock seeds then differ in every pair, in seconds, milliseconds or
nanoseconds alike.

Why forward, and why 5.5 s: the half second makes ``int()`` and ``round()`` of the two
readings differ whatever the runs' start skew below 5 s; a few seconds forward is harmless for
what else reads the wall clock: deadlines computed and checked with ``time.time`` keep
their length (both ends move), timeouts on ``monotonic``/``perf_counter`` (nondet's own
included) are untouched, log timestamps are 5.5 s late, and a file the run wrote looks
5.5 s old rather than from the future (a "modified in the future" check cannot trip).
Only a staleness check with a threshold under 5.5 s on a file written by another process
could change its mind. File times themselves (``os.stat``) are the real ones.

Every run gets the same ``datetime.datetime`` replacement (a subclass whose metaclass keeps
``isinstance`` true for every datetime, with the same repr and pickle name), offset 0 in
run a, so the two runs differ in the clock's value only, never in which class they use.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from nondet import standin

OFFSET_SECONDS = 5.5
#: The fact that tells the analysis how far this run's clock was moved (shown in a finding).
CLOCK_FACT = "clock_offset"


def offset_for(label: str) -> float:
    """Seconds this run's clock runs ahead: 0 for run a, OFFSET_SECONDS for run b and its
    re-runs (``b-ops``, ``b-dump``), N * OFFSET_SECONDS for ``rN`` (``--runs``)."""
    if label == "b" or label.startswith("b-"):
        return OFFSET_SECONDS
    numbered = re.fullmatch(r"r(\d+)", label)
    return int(numbered.group(1)) * OFFSET_SECONDS if numbered else 0.0


def shift(offset: float) -> None:
    """Move this process's wall clock ``offset`` seconds ahead (see module docstring)."""
    real_time, real_time_ns = time.time, time.time_ns
    offset_ns = int(offset * 1e9)

    def shifted_time() -> float:
        value = real_time() + offset
        if _is_user is not None:
            _note(value, None)
        return value

    def shifted_time_ns() -> int:
        value = real_time_ns() + offset_ns
        if _is_user is not None:
            _note(value / 1e9, value)
        return value

    time.time = _unbound(shifted_time, real_time)
    time.time_ns = _unbound(shifted_time_ns, real_time_ns)
    for name in ("localtime", "gmtime", "ctime"):
        real = getattr(time, name)
        setattr(time, name, _unbound(_default_now(real), real))
    real_strftime, localtime = time.strftime, time.localtime

    def strftime(format: str, t: Any = None) -> str:
        return real_strftime(format, localtime() if t is None else t)

    time.strftime = _unbound(strftime, real_strftime)
    standin.install(datetime, "datetime", _shifted_datetime())


def _default_now(function: Any) -> Any:
    """``time.localtime()`` & co. read the C clock: give them the shifted ``time.time``."""

    def at(secs: float | None = None) -> Any:
        return function(time.time() if secs is None else secs)

    return at


def _unbound(function: Any, real: Any) -> Any:
    """``function`` in place of the builtin ``real``, and like a builtin never bound as a
    method: code keeps these in class attributes (``logging.Formatter.converter =
    time.localtime``, read as ``self.converter(secs)``; ``class Timer: now = time.time``),
    where a Python function would be passed the instance. A ``functools.partial`` has no
    ``__get__`` and starts no Python frame of its own (``_note`` counts frames)."""
    stand_in = functools.partial(function)
    for name in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(stand_in, name, getattr(real, name))
        except (AttributeError, TypeError):
            pass
    return stand_in


def _shifted_datetime() -> type:
    base = datetime.datetime

    meta = standin.metaclass_for(base)

    class ShiftedDatetime(base, metaclass=meta):  # type: ignore[misc,valid-type,metaclass]
        __slots__ = ()  # the C layout of datetime.datetime (standin module docstring)

        # now() and utcnow() read the C clock directly; fromtimestamp(time.time()) is the
        # same value through the (shifted) Python clock.
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> Any:
            return cls.fromtimestamp(time.time(), tz)

        @classmethod
        def utcnow(cls) -> Any:
            return cls.fromtimestamp(time.time(), datetime.UTC).replace(tzinfo=None)

    standin.finish(ShiftedDatetime, base)
    # a heap type's repr uses __name__: keep "datetime.datetime(2026, ...)" as it was
    ShiftedDatetime.__name__ = f"{base.__module__}.{base.__name__}"
    return ShiftedDatetime


# -- where a clock seed came from ---------------------------------------------------------------
#: The user's lines that read the clock, with the last value each read: (seconds, ns or None).
_READS: dict[tuple[str, int], tuple[float, int | None]] = {}
_MAX_READS = 64
_is_user: Callable[[str], bool] | None = None


def watch_reads(is_user: Callable[[str], bool]) -> None:
    """Remember the clock readings the user's own lines make (``origin_of``)."""
    global _is_user
    _is_user = is_user


def _note(seconds: float, ns: int | None) -> None:
    """One reading: kept when the user's line made it (through ``datetime.now()`` too)."""
    try:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back  # datetime.now(), localtime(): the line that called them
        if frame is None or _is_user is None or not _is_user(frame.f_code.co_filename):
            return
        key = (frame.f_code.co_filename, frame.f_lineno)
        if key not in _READS and len(_READS) >= _MAX_READS:
            del _READS[next(iter(_READS))]  # the oldest line
        _READS[key] = (seconds, ns)
    except Exception:  # a clock reading must never fail because nondet looked at it
        pass


#: Units a seed is read from the clock in, and the moduli scripts fold it with. Moduli under
#: 10**6 are left out: a small seed would match some reading by chance too often.
_SCALES = ((1, "s"), (10**3, "ms"), (10**6, "us"), (10**9, "ns"))
_MODULI = (None, 2**32, 2**31, 2**31 - 1, 2**32 - 1, 2**63, 2**64, 10**6, 10**7, 10**8, 10**9)


def origin_of(value: Any) -> tuple[str, int, str] | None:
    """(file, line, derivation) of the user's clock reading this seed equals, if any:
    ``int(time.time())``, ``int(time.time() * 1000) % 2**32``, ``time.time_ns()``, ...
    Only plain numbers; None when no reading matches."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not _READS:
        return None
    for (filename, line), (seconds, ns) in reversed(_READS.items()):
        how = _derivation(value, seconds, ns)
        if how is not None:
            return filename, line, how
    return None


def _derivation(value: int | float, seconds: float, ns: int | None) -> str | None:
    if isinstance(value, float):
        return "seconds" if value == seconds else None
    for scale, unit in _SCALES:
        exact = ns // (10**9 // scale) if ns is not None else None
        scaled = seconds * scale
        for candidate in {exact, math.floor(scaled), round(scaled)}:
            if candidate is None:
                continue
            for modulus in _MODULI:
                if value == (candidate if modulus is None else candidate % modulus):
                    return unit if modulus is None else f"{unit} % {modulus}"
    return None
