"""Framework backends behind one small interface, installed when the framework is imported.

A backend is created the moment the user's script finishes importing its framework, so a
script that imports torch late (or inside a function) is covered, and nondet itself never
imports a framework it does not need. ``BACKENDS`` maps the framework's top-level module to
the module that provides ``create(session) -> Backend``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType

from nondet.frameworks.base import Backend, Session

BACKENDS: dict[str, str] = {
    "torch": "nondet.frameworks.torch",
    "tensorflow": "nondet.frameworks.tensorflow",
}


#: Packages a backend watches for, which may be imported *before* their framework: Keras 3
#: imports tensorflow from its own ``__init__``, so the TensorFlow backend only exists (and
#: registers its Keras hooks) while ``keras`` is still half-imported.
WATCHED_EARLY = ("keras",)

_installed: list[Backend] = []
_watchers: dict[str, list[Callable[[], None]]] = {}


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` once ``module`` has been imported (now, if it already has been)."""
    loaded = sys.modules.get(module)
    initializing = getattr(getattr(loaded, "__spec__", None), "_initializing", False)
    if loaded is not None and not initializing:
        callback()
    else:
        _watchers.setdefault(module, []).append(callback)


def _install(session: Session, framework: str) -> None:
    try:
        module = importlib.import_module(BACKENDS[framework])
        backend: Backend = module.create(session)
    except Exception:
        # A broken hook must not break the user's run; the parent reports it as a nondet bug.
        session.send_meta({"hook_error": traceback.format_exc()})
        return
    _installed.append(backend)
    session.backends.append(backend)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs a callback right after a watched top-level package finishes importing."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._busy: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        watched = fullname in BACKENDS or fullname in _watchers or fullname in WATCHED_EARLY
        if not watched or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original_exec = loader.exec_module
        session = self._session

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            if fullname in BACKENDS:
                _install(session, fullname)
            for callback in _watchers.pop(fullname, []):
                try:
                    callback()
                except Exception:
                    session.send_meta({"hook_error": traceback.format_exc()})

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_import_hooks(session: Session) -> None:
    sys.meta_path.insert(0, _PostImportFinder(session))
    # A framework imported before the script (by a sitecustomize, a .pth file) never passes
    # the finder: its backend now, or nothing was recorded ("no training step was observed")
    for framework in BACKENDS:
        loaded = sys.modules.get(framework)
        if loaded is not None and not getattr(getattr(loaded, "__spec__", None),
                                              "_initializing", False):
            _install(session, framework)


def finish_all(session: Session, status: str) -> str:
    for backend in list(_installed):
        try:
            status = backend.finish(status)
        except Exception:
            session.send_meta({"hook_error": traceback.format_exc()})
    return status


def adopt(session: Session, backend: Backend) -> None:
    """A backend made outside the import hooks (a recorded child process's own): it is
    disabled in processes forked from there like every other."""
    _installed.append(backend)
    session.backends.append(backend)


def disable_after_fork() -> None:
    for backend in _installed:
        backend.disable()
