"""The ``os`` and ``select`` functions nondet's child code calls, as they were when nondet
was imported, before the script ran.

nondet's code inside a run compares pids (is it a forked copy of the run, which must not
write to the run's pipe; is its parent gone?) and reads and writes its pipes. A script may
replace those functions for its own reasons: a test's mock of ``os.getpid`` made a run think
it was a fork and go silent, one of ``os.getppid`` made it think it was orphaned and end
itself (faults round 11); a sandbox's ``os.fstat`` that refuses descriptors above 2 made
nondet's pipe guard lose the pipe, and nondet said the script never trained (round 13).
"""

from __future__ import annotations

import os
import select as _select

getpid = os.getpid
exit_now = os._exit  # before exit_place wraps it
getppid = os.getppid
fstat = os.fstat
open_fd = os.open
read = os.read
write = os.write
dup = os.dup
set_blocking = os.set_blocking
select = _select.select
