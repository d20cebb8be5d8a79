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
import re
import time
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
        return real_time() + offset

    def shifted_time_ns() -> int:
        return real_time_ns() + offset_ns

    shifted_time.__doc__, shifted_time_ns.__doc__ = real_time.__doc__, real_time_ns.__doc__
    time.time, time.time_ns = shifted_time, shifted_time_ns
    for name in ("localtime", "gmtime", "ctime"):
        setattr(time, name, _default_now(getattr(time, name)))
    real_strftime, localtime = time.strftime, time.localtime

    def strftime(format: str, t: Any = None) -> str:
        return real_strftime(format, localtime() if t is None else t)

    strftime.__doc__ = real_strftime.__doc__
    time.strftime = strftime
    real_datetime = datetime.datetime
    datetime.datetime = _shifted_datetime()  # type: ignore[misc,assignment]
    _real_datetime_for_extensions(real_datetime)


def _real_datetime_for_extensions(real: type) -> None:
    """C extensions loaded from now on see the real ``datetime.datetime`` while they load.

    Cython modules (pandas' ``Timestamp``) read ``datetime.datetime`` once at import and
    build static types on it: a Python subclass there crashes the garbage collector. They
    read the clock through the C API, which the stand-in never covered anyway.
    """
    import importlib.machinery

    loader = importlib.machinery.ExtensionFileLoader
    for name in ("create_module", "exec_module"):
        original = getattr(loader, name)

        def with_real_datetime(self: Any, arg: Any, _original: Any = original) -> Any:
            stand_in = datetime.datetime
            datetime.datetime = real  # type: ignore[misc,assignment]
            try:
                return _original(self, arg)
            finally:
                datetime.datetime = stand_in  # type: ignore[misc]

        setattr(loader, name, with_real_datetime)


def _default_now(function: Any) -> Any:
    """``time.localtime()`` & co. read the C clock: give them the shifted ``time.time``."""

    def at(secs: float | None = None) -> Any:
        return function(time.time() if secs is None else secs)

    at.__doc__ = function.__doc__
    return at


def _shifted_datetime() -> type:
    base = datetime.datetime

    meta = standin.metaclass_for(base)

    class ShiftedDatetime(base, metaclass=meta):  # type: ignore[misc,valid-type,metaclass]
        # No __dict__: C extensions built on datetime (pandas' Timestamp, Cython
        # `cimport datetime`) take this class as their base and lay out their own fields
        # right after datetime's; an extra __dict__ slot makes them overlap (segfault).
        __slots__ = ()

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
