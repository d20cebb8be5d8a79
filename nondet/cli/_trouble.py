"""Errors of the machine nondet runs on, not of nondet: they are the user's to fix (one
line, exit 2), never "internal error" with a bug log. Asked by ``_common.handle_errors``
about an exception that reached it."""

from __future__ import annotations

import errno
import os
import resource
import sys
import types
from types import TracebackType

#: what nondet itself imports (pyproject's dependencies, and the ``html`` extra)
DEPENDENCIES = ("numpy", "h5py", "click", "rich", "jinja2", "markupsafe")


def explain(exc: BaseException) -> str | None:
    """The line for ``exc`` if it is the machine's trouble, else None (a bug)."""
    return (resource_limit(exc) or unusable_path(exc) or too_long_to_start(exc)
            or broken_dependency(exc))


def too_long_to_start(exc: BaseException) -> str | None:
    """A run could not be started: its arguments and environment together exceed what the
    kernel takes (E2BIG). The script's arguments are passed as ``python`` would pass them;
    what is left over is the environment (huge variables)."""
    if not isinstance(exc, OSError) or exc.errno != errno.E2BIG:
        return None
    size = sum(len(k) + len(v) + 2 for k, v in os.environ.items())
    return (f"a run could not be started: {exc.strerror} (the script's arguments and the "
            f"environment, {size:,} bytes of it, exceed what the system takes); shorten "
            "them (a file listing the arguments, fewer or shorter variables)")


#: errors that say a path given to nondet (or made from one: a capture under ``--out``) cannot
#: name a file at all, whatever nondet does with it
_PATH_ERRORS = {errno.ENAMETOOLONG: "give a shorter path",
                errno.ELOOP: "a symbolic link on it leads back to itself"}


def unusable_path(exc: BaseException) -> str | None:
    """A path that cannot name a file (a name over 255 bytes, a symlink loop): it was
    "internal error", exit 3, for ``--out``, ``--json``, ``--junit``, ``--baseline``, ``--html``
    and the captures of ``show``/``diff``/``report``."""
    if not isinstance(exc, OSError) or exc.errno not in _PATH_ERRORS or exc.filename is None:
        return None
    return (f"cannot use the path {os.fsdecode(exc.filename)}: {exc.strerror} "
            f"({_PATH_ERRORS[exc.errno]})")


def resource_limit(exc: BaseException) -> str | None:
    """nondet itself ran out of descriptors or memory (``ulimit -n``, ``ulimit -v``)."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        what, limit, option = "open files", resource.RLIMIT_NOFILE, "-n"
    elif isinstance(exc, MemoryError) or (isinstance(exc, OSError)
                                          and exc.errno == errno.ENOMEM):
        what, limit, option = "memory", resource.RLIMIT_AS, "-v"
    else:
        return None
    soft, _ = resource.getrlimit(limit)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else (
        str(soft) if option == "-n" else f"{soft // 1024} KiB")
    return (f"nondet ran out of {what} ({type(exc).__name__}: {exc}); `ulimit {option}` "
            f"is {shown}: nondet runs the script twice and needs more than one run of it "
            f"alone, so raise the limit (or free {what}) and run again")


def broken_dependency(exc: BaseException) -> str | None:
    """A package nondet needs failed while it was imported (a module of that name earlier
    on ``PYTHONPATH`` shadowing the installed one, a broken install)."""
    package, path = _failed_import(exc)
    if package is None:
        return None
    where = f" from {path}" if path else ""
    entry = _pythonpath_entry(path) if path else None
    fix = (f"the PYTHONPATH entry {entry} puts it before the installed {package}: remove "
           "that entry (or rename the module)" if entry else
           f"reinstall it (pip install --force-reinstall {package})")
    return (f"importing {package}{where} failed ({type(exc).__name__}: {exc}); nondet "
            f"needs {package}: {fix}")


def _failed_import(exc: BaseException) -> tuple[str | None, str | None]:
    """(package, its file) when ``exc`` was raised importing one of ``DEPENDENCIES``."""
    if isinstance(exc, ImportError) and exc.name:
        root = exc.name.split(".")[0]
        if root in DEPENDENCIES:
            module = sys.modules.get(root)
            return root, getattr(module, "__file__", None) or exc.path
    obj = getattr(exc, "obj", None)  # AttributeError: the module that lacks the name
    if isinstance(exc, AttributeError) and isinstance(obj, types.ModuleType):
        root = obj.__name__.split(".")[0]
        path = getattr(obj, "__file__", None)
        # a real install has a version; one that lacks it, or lies on PYTHONPATH, is not
        # the package (otherwise a name nondet wrongly uses is nondet's bug)
        if root in DEPENDENCIES and (not hasattr(obj, "__version__")
                                     or (path and _pythonpath_entry(path))):
            return root, path
    for name, code, filename in _frames(exc.__traceback__):
        # outermost first: a dependency's module body running is its import
        root = name.split(".")[0]
        if root in DEPENDENCIES and code == "<module>":
            return root, filename
    return None, None


def _frames(tb: TracebackType | None) -> list[tuple[str, str, str]]:
    """(module name, code name, file) of each frame, outermost first."""
    out = []
    while tb is not None:
        frame = tb.tb_frame
        out.append((str(frame.f_globals.get("__name__", "")), frame.f_code.co_name,
                    frame.f_code.co_filename))
        tb = tb.tb_next
    return out


def _pythonpath_entry(path: str) -> str | None:
    """The PYTHONPATH entry ``path`` lies under, if any."""
    real = os.path.realpath(path)
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and real.startswith(os.path.realpath(entry) + os.sep):
            return entry
    return None
