"""Where a run's script ended early: the user's line that called ``sys.exit`` or ``os._exit``.

Child side: ``note_system_exit`` (boot.py, on ``SystemExit``) and ``install`` (``os._exit``
wrapped) send the fact ``EXIT_FACT`` = {"source": "train.py:12", "how": "sys.exit"}, the
line's text interned with it. Parent side: ``ended_at`` reads it back from a capture, so a
finding "run b ended after 4 steps, run a went on" names the line that ended run b.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nondet.session import Session
    from nondet.store import Capture

EXIT_FACT = "script.ended_at"


def _innermost_user_frame(tb: TracebackType | None, session: Session) -> tuple[str, int] | None:
    found = None
    while tb is not None:  # outermost first: keep the last user frame
        if session.sources.user_file(tb.tb_frame.f_code.co_filename):
            found = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        tb = tb.tb_next
    return found


def _send(session: Session, place: tuple[str, int], how: str) -> None:
    session.sources.intern_location(*place)  # the line's text goes into the capture with it
    session.send_facts({EXIT_FACT: {"source": session.sources.display(*place), "how": how}})


def note_system_exit(session: Session, exc: SystemExit) -> None:
    """The script raised ``SystemExit``: remember the user's line that raised it."""
    try:
        place = _innermost_user_frame(exc.__traceback__, session)
        if place is not None:
            _send(session, place, "sys.exit")
    except Exception:  # a note about the run must never change how it ends
        pass


def install(session: Session) -> None:
    """Wrap ``os._exit``: it ends the process without ``SystemExit`` or END, so the line
    that called it is sent (and flushed) before the real call."""
    from nondet import session as session_module

    real_exit = os._exit

    def _exit(code: int) -> Any:
        try:
            # Forked children (DataLoader workers, multiprocessing) end with os._exit too:
            # only the run's own process, and only a call made by the user's code itself.
            caller = sys._getframe(1)
            if session_module.current() is session \
                    and session.sources.user_file(caller.f_code.co_filename):
                _send(session, (caller.f_code.co_filename, caller.f_lineno), "os._exit")
                session._send_strings()
                session.writer.flush()
        except BaseException:  # the exit must happen whatever failed
            pass
        real_exit(code)

    _exit.__wrapped__ = real_exit  # type: ignore[attr-defined]
    os._exit = _exit  # type: ignore[assignment]


def ended_at(capture: Capture) -> tuple[str, str] | None:
    """(source, how) of the line that ended this run's script, if it was recorded."""
    fact = capture.facts.get(EXIT_FACT)
    if not isinstance(fact, dict):
        return None  # not recorded, or a (crafted) capture holding something else
    source, how = fact.get("source"), fact.get("how")
    if not isinstance(source, str) or not isinstance(how, str) or not source:
        return None
    return source, how
