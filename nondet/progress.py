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

    def stage(self, text: str) -> None:
        if self.quiet:
            return
        self.console.print(f"[dim]nondet:[/] {escape(text)}", highlight=False)

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
            self._last_plain = time.monotonic()
            self.console.print(f"nondet: {escape(text)}", highlight=False)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
