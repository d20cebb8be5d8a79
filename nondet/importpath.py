"""A recorded run's import path: the one ``python script.py`` gives the script.

nondet starts each run as ``python -m nondet.boot``. Left alone, that puts the working
directory first on ``sys.path`` (``-m`` does: a ``signal.py`` there broke nondet's own
imports, "the script failed"), and nondet's directory on ``PYTHONPATH`` ahead of the user's
entries and of everything installed (its checkout's ``tests`` package hid the script's own
``tests/`` directory; a wheel's site-packages would come before the user's PYTHONPATH
overrides). So a run starts with ``PYTHONSAFEPATH=1`` and nondet's directory first
(``startup_env``); before the script, the run puts the user's variables back, moves nondet's
directory off ``sys.path`` (nondet is imported by then), or to its end when nondet is not
installed in this interpreter (a spawned process unpickles nondet's objects through it: a
regular package there, such as the checkout's ``tests``, still wins over a namespace
directory of the script's, so only then) and adds the script's directory, or the working
directory for ``-m``, as ``python`` would (``as_plain_python``).
"""

from __future__ import annotations

import os
import re
import sys
import zipfile
from pathlib import Path

PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
#: The variables a run's start changes; their user's values go in the child config.
STARTUP_VARIABLES = ("PYTHONPATH", "PYTHONSAFEPATH")


#: The script's failure when a module of its own named ``nondet`` (a ``nondet.py`` or a
#: ``nondet/`` folder beside it) is hidden by nondet's package, already imported in the run.
_OWN_NONDET = re.compile(r"module 'nondet' has no attribute|cannot import name '[^']*' from "
                         r"'nondet'|No module named 'nondet\.")
SHADOWED_HINT = ("; the script imports a module of its own named nondet (a nondet.py or a "
                 "nondet/ folder), which nondet's own package hides in a recorded run: "
                 "rename that module")


def shadowed_hint(failure: str) -> str:
    """``SHADOWED_HINT`` when a run's failure text shows the script reaching for a module
    of its own named ``nondet`` and getting nondet's package; "" otherwise."""
    return SHADOWED_HINT if _OWN_NONDET.search(failure) else ""


def startup_env(env: dict[str, str]) -> dict[str, str | None]:
    """Set ``env`` (a run's environment) up to start ``nondet.boot``; returns the user's
    values of what it changed (None: unset), for ``as_plain_python``."""
    saved = {name: env.get(name) for name in STARTUP_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONSAFEPATH"] = "1"
    return saved


def script_entry(script: str) -> str | None:
    """What ``python SCRIPT`` puts first on ``sys.path``: the script's directory, symbolic
    links resolved (``train.py`` linked from elsewhere imports its sibling modules from
    where it really is); for a directory or zip file run by its ``__main__.py``, None
    (``runpy.run_path`` puts the directory or archive itself there, as python does)."""
    if os.path.isdir(script) or zipfile.is_zipfile(script):
        return None
    return os.path.dirname(os.path.realpath(script))


def as_plain_python(saved: dict[str, str | None], first: str | None) -> None:
    """In the run, once nondet is imported: the user's variables back (the script's own
    subprocesses inherit them), nondet's directory last, ``first`` (the script's directory,
    or the working directory for ``-m``) at the front unless the user asked for a safe path."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if STARTUP_VARIABLES[0] in saved and sys.path[:1] == [PACKAGE_PARENT]:
        del sys.path[0]  # the entry startup_env put first; a user's own entry stays
        if not _installed():
            sys.path.append(PACKAGE_PARENT)
    if first is not None and not saved.get("PYTHONSAFEPATH"):
        sys.path.insert(0, first)


def _installed() -> bool:
    """Whether nondet is found without its directory on ``sys.path`` (a wheel in
    site-packages, an editable install's finder)."""
    for finder in sys.meta_path:
        try:
            if finder.find_spec("nondet", None) is not None:
                return True
        except Exception:  # a finder of the script's environment that fails: not there
            continue
    return False
