"""A run that ended with KeyboardInterrupt is Ctrl-C (exit 130) only if nondet was
interrupted too; otherwise the script ended itself that way (trial: a script that raises
KeyboardInterrupt after training was reported as "nondet: interrupted", exit 130)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from nondet import channel, errors
from nondet.errors import ScriptFailed
from nondet.runspec import RunResult
from nondet.schedule import check_result


def _interrupted_run(tmp_path: Path) -> RunResult:
    log = tmp_path / "run-a.log"
    log.write_text("Traceback (most recent call last):\nKeyboardInterrupt\n")
    return RunResult(label="a", path=tmp_path / "run-a.h5", log_path=log,
                     status=channel.INTERRUPTED, exit_code=130, steps=3)


@pytest.fixture
def _watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(errors, "_sigint", {"watched": False, "seen": False})
    monkeypatch.setattr(signal, "getsignal", lambda signum: signal.default_int_handler)
    installed: list[object] = []
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.append(handler))
    errors.watch_sigint()
    assert installed


@pytest.mark.usefixtures("_watched")
def test_a_run_interrupted_while_nondet_was_not_is_the_scripts_own_failure(
        tmp_path: Path) -> None:
    with pytest.raises(ScriptFailed, match="KeyboardInterrupt in run a though nondet was not"):
        check_result(_interrupted_run(tmp_path))


@pytest.mark.usefixtures("_watched")
def test_a_run_interrupted_with_nondet_is_ctrl_c(tmp_path: Path) -> None:
    errors._sigint["seen"] = True
    with pytest.raises(KeyboardInterrupt):
        check_result(_interrupted_run(tmp_path))


def test_the_handler_notes_sigint_and_raises_as_pythons_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(errors, "_sigint", {"watched": False, "seen": False})
    monkeypatch.setattr(errors, "_ending", {"now": False})
    previous = signal.getsignal(signal.SIGINT)
    try:
        # as in a terminal: a test runner's worker (pytest-xdist) may ignore SIGINT, and
        # watch_sigint leaves an ignored SIGINT alone
        signal.signal(signal.SIGINT, signal.default_int_handler)
        errors.watch_sigint()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs within the sleep
        assert errors.interrupted_here()
        # A second SIGINT while nondet ends its runs (`timeout` forwards Ctrl-C to nondet
        # and again to its group) is not raised into the clean-up.
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler has run, and raised nothing
    finally:
        signal.signal(signal.SIGINT, previous)
