"""This process's pid and its parent's, read through the functions ``os`` had when nondet
was imported, before the script ran.

nondet's child code compares pids to know whether it runs in a forked copy of the run
(which must not write to the run's pipe) and whether its parent is gone. A script that
replaces ``os.getpid`` or ``os.getppid`` (a test's mock) made a run think it was a fork and
go silent, or orphaned and end itself (faults round 11: runs killed, steps missed).
"""

from __future__ import annotations

import os

getpid = os.getpid
getppid = os.getppid
