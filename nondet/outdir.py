"""Where one invocation's captures go, and which old files nondet may remove.

Every ``nondet run``/``check`` gets a directory of its own under ``--out``::

    .nondet/
      20261123-112552-4242/        one invocation: <start time>-<pid>
        .nondet-invocation         the marker nondet wrote (who, when, which command)
        run-a.h5  run-a.log  ...
      latest -> 20261123-112552-4242   the invocation that finished last

so two invocations in one project never share (or overwrite) a capture, and ``--out .``
never touches the project's own files. nondet deletes only what it can prove it made: a
directory whose name has the invocation pattern *and* that holds nondet's marker, and in
it only the files nondet listed there as it made them (``claim``: the captures and logs of
its runs). Anything else (a user's ``run-notes.log``, a baseline kept next to the
captures, an invocation directory someone added files to, one made before nondet kept that
list) stays.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from nondet.errors import NondetError

#: The file that proves a directory is one invocation's, written first thing.
MARKER = ".nondet-invocation"
MAGIC = "nondet invocation directory"
#: The pointer to the invocation that finished last.
LATEST = "latest"
#: Invocation directories kept when older ones are pruned (the current one included).
KEEP = 5

#: The names of the files nondet made in an invocation directory, one per line (``claim``).
MADE = ".nondet-made"

_NAME = re.compile(r"^\d{8}-\d{6}-\d+(\.\d+)?$")


@dataclass(frozen=True)
class Invocation:
    root: Path  # --out
    path: Path  # root / name: this invocation's captures

    @property
    def name(self) -> str:
        return self.path.name


def _kind(path: Path) -> str:
    """What a path that is not a directory is, in words ("a file" for a FIFO misled)."""
    mode = path.stat().st_mode
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a file"


def check_root(root: Path) -> None:
    """Refuse an --out nondet cannot write into, before any run starts (exit 2)."""
    existing = root
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():  # mkdir said only "File exists"
        raise NondetError(f"--out {display(root)}: {display(existing)} is a symbolic link to "
                          f"{display(os.readlink(existing))}, which does not exist or leads "
                          "back to itself; make that directory, or give --out another")
    if existing.exists() and not existing.is_dir():
        raise NondetError(f"--out {display(root)}: {display(existing)} is {_kind(existing)}, "
                          "not a directory; give --out a directory to write the captures into")
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise NondetError(f"--out {display(root)}: {display(existing)} is not writable")


def start(root: Path) -> Invocation:
    """Make this invocation's directory (with its marker) under ``root``; prune old ones."""
    check_root(root)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for attempt in range(100):
            path = root / (stamp if attempt == 0 else f"{stamp}.{attempt}")
            try:
                path.mkdir()  # never an existing directory: that one is someone else's
                break
            except FileExistsError:
                continue
        else:
            raise NondetError(f"--out {display(root)}: cannot make a directory of its own there")
        marker = {"magic": MAGIC, "pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now().isoformat(timespec="seconds"),
                  "started_epoch": time.time(),  # the order of invocations (Note [Pruning order])
                  "command": [display(Path(a)) for a in sys.argv]}
        (path / MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
    except OSError as exc:
        raise NondetError(f"cannot write the captures into --out {display(root)}: "
                          f"{exc.strerror or exc}") from exc
    invocation = Invocation(root=root, path=path)
    prune(root, keep=KEEP, current=invocation.name)
    return invocation


def named_like_invocation(path: Path) -> bool:
    """True for a path named as this module names invocation directories (it may be gone)."""
    return bool(_NAME.match(path.name))


def is_invocation(path: Path) -> bool:
    """True only for a directory nondet made: the name pattern and nondet's marker in it."""
    if path.is_symlink() or not path.is_dir() or not _NAME.match(path.name):
        return False
    try:
        data = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("magic") == MAGIC


def is_own(path: Path) -> bool:
    """True for an invocation directory made by this very process."""
    if not is_invocation(path):
        return False
    try:
        data = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(data.get("pid") == os.getpid() and data.get("host") == socket.gethostname())


def _in_use(path: Path) -> bool:
    """A directory of an invocation still running on this machine is never pruned."""
    try:
        data = json.loads((path / MARKER).read_text(encoding="utf-8"))
        pid = int(data.get("pid", -1))
    except (OSError, ValueError, TypeError):
        return True
    if data.get("host") != socket.gethostname():
        return False  # made on another machine: its age is what counts
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def writer_running(capture: Path) -> bool:
    """Whether ``capture`` lies in the directory of another nondet invocation still running
    on this machine (its marker's pid is alive and is a nondet). With file locking off
    (``HDF5_USE_FILE_LOCKING=FALSE``, common on network file systems) HDF5 cannot tell a
    capture being written from one whose writer was killed; this can."""
    folder = capture.parent
    if not is_invocation(folder):
        return False
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        pid = int(data.get("pid", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    if pid == os.getpid() or data.get("host") != socket.gethostname() or not _in_use(folder):
        return False
    try:  # the pid may have been reused since that nondet ended
        return b"nondet" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # cannot tell (no /proc): the pid is alive


# Note [Pruning order]
# ~~~~~~~~~~~~~~~~~~~~
# An invocation directory is named by the local time it started, which is what a user
# reads. Names do not order invocations when the time zone differs between them (a shell
# with `TZ=Asia/Tokyo` beside a cron job in UTC, a summer-time change): one started under a
# zone 14 hours ahead sorted after every later one, so pruning kept it and deleted the
# newest captures of the other zone two invocations later. The marker keeps the start as
# seconds since the epoch, and that orders them; a marker without it (written before this
# field existed) is ordered by its name read in this process's zone, as before.


def _started(path: Path) -> tuple[float, str]:
    try:
        data = json.loads((path / MARKER).read_text(encoding="utf-8"))
        return float(data["started_epoch"]), path.name
    except (OSError, ValueError, TypeError, KeyError):
        pass
    try:
        return datetime.strptime(path.name[:15], "%Y%m%d-%H%M%S").timestamp(), path.name
    except (ValueError, OverflowError, OSError):
        return 0.0, path.name


def claim(path: Path) -> None:
    """List ``path``, a file nondet is about to make, as nondet's own for ``prune``, when
    its directory is an invocation's (other directories are the user's: nothing is
    listed, nothing there is ever removed). One short append: runs of one invocation in
    parallel processes do not interleave. On any error the file is simply not listed
    (then kept)."""
    if not (path.parent / MARKER).is_file():
        return
    try:
        with open(path.parent / MADE, "a", encoding="utf-8") as made:
            made.write(path.name + "\n")
    except OSError:
        pass


def _made(path: Path) -> set[str]:
    try:
        return set((path / MADE).read_text(encoding="utf-8").splitlines())
    except (OSError, ValueError):
        return set()


def prune(root: Path, *, keep: int, current: str = "") -> list[Path]:
    """Remove old invocation directories beyond the newest ``keep``; returns those removed.

    Only directories ``is_invocation`` accepts, not in use, and in them only nondet's own
    files (those ``claim`` listed, the list, the marker); a directory holding anything
    else is left as it is.
    """
    try:
        mine = sorted((p for p in root.iterdir() if is_invocation(p)), key=_started)
    except OSError:
        return []
    removed = []
    for path in mine[: max(len(mine) - keep, 0)]:
        if path.name == current or _in_use(path):
            continue
        try:
            made = _made(path)
            others = [p for p in path.iterdir()
                      if p.name not in (MARKER, MADE) and not (
                          p.name in made and p.is_file() and not p.is_symlink())]
            if others:
                continue  # someone put their own files here: not ours to delete
            for p in path.iterdir():
                if p.name not in (MARKER, MADE):
                    p.unlink()
            (path / MADE).unlink(missing_ok=True)
            (path / MARKER).unlink()
            path.rmdir()
            removed.append(path)
        except OSError:
            continue  # a race with another invocation, or permissions: leave it
    return removed


def finish(invocation: Invocation) -> None:
    """Point ``root/latest`` at this invocation (a symlink, replaced atomically).

    A ``latest`` that is not nondet's (a regular file or directory, or a link to something
    that is not an invocation directory) is left alone.
    """
    link = invocation.root / LATEST
    if link.exists() or link.is_symlink():
        if not link.is_symlink():
            return
        target = Path(os.readlink(link))
        if target.parent != Path(".") or not _NAME.match(target.name):
            return
    temporary = invocation.root / f".{LATEST}.{os.getpid()}.tmp"
    try:
        temporary.symlink_to(invocation.name, target_is_directory=True)
    except OSError:
        return  # no symlinks here (or that name is taken): the directories still say it all
    try:
        os.replace(temporary, link)
    except OSError:
        temporary.unlink(missing_ok=True)


def display(path: Path | str) -> str:
    """A path as printable text (bytes that are not UTF-8 shown as \\xNN)."""
    return str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
