"""Progress while runs are going: a live status line on a terminal, plain lines otherwise."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape

from nondet.printable import printable


class Progress:
    """Stages are printed as lines; statuses replace each other (throttled when not a TTY)."""

    def __init__(self, console: Console, quiet: bool = False) -> None:
        self.console = console
        self.quiet = quiet
        self._status: Any = None
        self._last_plain = 0.0
        # Not a TTY: the latest status not printed (throttled). It is printed before the
        # next stage and at the end, or a log read "step 0: both runs done" for a whole
        # 200-step run that took less than the throttle's 15 s.
        self._unprinted: str | None = None

    def stage(self, text: str) -> None:
        if self.quiet:
            return
        self._print_unprinted()
        self.console.print(f"[dim]nondet:[/] {escape(text)}", highlight=False)

    def _print_unprinted(self) -> None:
        if self._unprinted is not None:
            self.console.print(f"nondet: {escape(self._unprinted)}", highlight=False)
            self._unprinted = None
            self._last_plain = time.monotonic()

    def status(self, text: str) -> None:
        if self.quiet:
            return
        text = printable(text)  # a status is drawn by rich's live display, not print()
        if self.console.is_terminal:
            if self._status is None:
                self._status = self.console.status(escape(text))
                self._status.start()
            else:
                self._status.update(escape(text))
        elif time.monotonic() - self._last_plain > 15:
            self._unprinted = text
            self._print_unprinted()
        else:
            self._unprinted = text

    def close(self) -> None:
        self._print_unprinted()
        if self._status is not None:
            self._status.stop()
            self._status = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
