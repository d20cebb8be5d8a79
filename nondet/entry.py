"""The ``nondet`` console script: the command line, and a Ctrl-C that comes while it is
still being imported (click, rich: a fraction of a second) ending as any other Ctrl-C does
(one line, exit 130), where Python printed a ``KeyboardInterrupt`` traceback."""

from __future__ import annotations

import sys

#: The exit code of an interrupted command (nondet.exitcodes, not imported here: it is the
#: import that may be interrupted).
_INTERRUPTED = 130


def main() -> None:
    try:
        from nondet.cli import main as command_line
    except KeyboardInterrupt:
        sys.stderr.write("nondet: interrupted\n")
        sys.exit(_INTERRUPTED)
    command_line()
