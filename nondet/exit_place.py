"""Where a run's script ended early: the user's line that called ``sys.exit`` or ``os._exit``.

Child side: ``note_system_exit`` (boot.py, on ``SystemExit``) and ``install`` (``os._exit``
wrapped) send the fact ``EXIT_FACT`` = {"source": "train.py:12", "how": "sys.exit"}, the
line's text interned with it. Parent side: ``ended_at`` reads it back from a capture, so a
finding "run b ended after 4 steps, run a went on" names the line that ended run b.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

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
    for name in ("execv", "execve"):  # every os.exec* function ends in one of these
        setattr(os, name, _noting_exec(session, getattr(os, name), name))
    for name in ("fork", "forkpty"):
        if hasattr(os, name):
            setattr(os, name, _noting_fork(session, getattr(os, name), name))


#: fact keys of a capture whose script replaced its process (``os.exec*``): the note,
#: and the call with its line ("os.execv at train.py:5")
EXEC_FACT = "capture_note.exec"
EXEC_AT_FACT = "python.exec_at"
#: the note on a capture whose script replaced its process (``os.exec*``)
EXEC_NOTE = ("the script replaced its process with another program ({how} at {source}): "
             "what that program did is not recorded, so only the steps before it are "
             "compared")


def _noting_exec(session: Session, real: Callable[..., NoReturn], name: str
                 ) -> Callable[..., NoReturn]:
    """``os.execv``/``os.execve`` ends the run's Python without SystemExit or END: the
    line that called it is sent (and flushed) first, with a note that nothing after it is
    recorded (the exec'd program inherits no hooks)."""
    from nondet import session as session_module

    def exec_(*args: Any, **kwargs: Any) -> NoReturn:
        try:
            place = _user_caller(session)
            if session_module.current() is session and place is not None:
                how = f"os.{name}"
                _send(session, place, how)
                shown = session.sources.display(*place)
                session.send_facts({EXEC_FACT: EXEC_NOTE.format(how=how, source=shown),
                                    EXEC_AT_FACT: f"{how} at {shown}"})
                session._send_strings()
                session.writer.flush()
        except BaseException:  # the exec must happen whatever failed
            pass
        real(*args, **kwargs)

    exec_.__wrapped__ = real  # type: ignore[attr-defined]
    return exec_


#: the note on a capture whose script forked a child process itself (``os.fork``)
FORK_NOTE = ("the script forked at {source} ({how}): the child process is not recorded, so "
             "what it does there (training steps, if any) is not compared; start it with "
             "multiprocessing.Process(target=...) to have its steps recorded and compared")
#: fact key prefix of a fork note (one per forking line)
FORK_FACT = "capture_note.fork:"


def _noting_fork(session: Session, real: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A bare ``os.fork`` in the user's code: the child runs on unrecorded (its hooks are
    off after a fork, as in DataLoader workers), so the parent notes the line. Forks made
    by libraries (multiprocessing, whose children children.py records) are not noted."""
    from nondet import session as session_module

    def fork(*args: Any, **kwargs: Any) -> Any:
        place = None
        try:
            if session_module.current() is session:
                place = _user_caller(session, direct=True)
        except BaseException:  # the fork must happen whatever failed
            pass
        result = real(*args, **kwargs)
        child = result[0] if isinstance(result, tuple) else result
        if place is not None and child != 0:  # the parent: the channel is its own
            try:
                shown = session.sources.display(*place)
                session.sources.intern_location(*place)
                session.send_facts({FORK_FACT + shown: FORK_NOTE.format(
                    how=f"os.{name}", source=shown)})
            except Exception:  # a note about the run must never change it
                pass
        return result

    fork.__wrapped__ = real  # type: ignore[attr-defined]
    return fork


def fork_notes(capture: Capture) -> list[str]:
    """The fork notes of a capture (one per forking line of the user's code)."""
    return [str(v) for k, v in capture.facts.items() if k.startswith(FORK_FACT)]


def _user_caller(session: Session, direct: bool = False) -> tuple[str, int] | None:
    """The innermost frame of the user's files calling in (os.execl goes through os.py);
    ``direct``: only the direct caller (a library's own fork is not the user's)."""
    frame: FrameType | None = sys._getframe(2)
    if direct:
        return (frame.f_code.co_filename, frame.f_lineno) \
            if frame is not None and session.sources.user_file(frame.f_code.co_filename) \
            else None
    while frame is not None:
        if session.sources.user_file(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def ended_at(capture: Capture) -> tuple[str, str] | None:
    """(source, how) of the line that ended this run's script, if it was recorded."""
    fact = capture.facts.get(EXIT_FACT)
    if not isinstance(fact, dict):
        return None  # not recorded, or a (crafted) capture holding something else
    source, how = fact.get("source"), fact.get("how")
    if not isinstance(source, str) or not isinstance(how, str) or not source:
        return None
    return source, how
