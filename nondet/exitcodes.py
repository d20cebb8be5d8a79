"""Exit codes of every nondet command (the contract in the README and docs/report.md)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    DETERMINISTIC = 0  # runs identical
    NONDETERMINISTIC = 1  # nondeterminism found and reported
    USAGE = 2  # bad arguments, unreadable file, missing framework, the script itself failed
    INTERNAL = 3  # a bug in nondet: a log with versions and traceback is written
    INTERRUPTED = 130  # Ctrl-C; captures written so far stay readable
    TERMINATED = 143  # SIGTERM (CI cancel, `timeout`), SIGHUP, SIGUSR1/2: captures closed, marked


EPILOG = (
    "Exit codes: 0 runs identical; 1 nondeterminism found; 2 usage or environment trouble "
    "(bad arguments, unreadable file, missing framework, the script failed); 3 internal error "
    "(a log is written); 130 interrupted; 143 terminated (SIGTERM, SIGHUP, SIGUSR1, SIGUSR2)."
)
