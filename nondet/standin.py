"""Stand-in classes: a subclass that replaces a class nondet cannot patch in place.

C types (``datetime.datetime``, ``np.random.RandomState``, ``torch.Generator``) cannot have
methods replaced, so nondet installs a subclass under the original name. The subclass must
look like the original to the user's code: ``isinstance(x, Original)`` stays true for every
instance of the original, however made (sklearn's ``check_random_state`` relies on it), and
repr and pickling name the original's module.

A stand-in declares ``__slots__ = ()``, so its instances have the original's C layout. Even so,
a C extension must never meet it while it initializes: Cython modules read such types from
their module when imported, check their size and subclass them as C types (pandas' Timestamp
derives from ``datetime.datetime``: built on a stand-in, ``import pandas`` crashed the run with
SIGSEGV). ``install`` therefore puts the original back for the length of every extension
module's initialization (``ExtensionFileLoader``) and the stand-in again after it; Python
code always sees the stand-in.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_MARK = "_stands_in"


def metaclass_for(base: type) -> type:
    """The metaclass of a stand-in for ``base``. Only the stand-in itself answers for every
    instance of the original; a class the user derives from it later keeps the usual
    answer."""

    class StandInMeta(type(base)):  # type: ignore[misc]
        def __instancecheck__(cls, obj: Any) -> bool:
            if _MARK in cls.__dict__:
                return isinstance(obj, base)
            return bool(super().__instancecheck__(obj))

        def __subclasscheck__(cls, other: type) -> bool:
            if _MARK in cls.__dict__:
                return issubclass(other, base)
            return bool(super().__subclasscheck__(other))

    return StandInMeta


def finish(stand_in: type, base: type) -> type:
    """Mark ``stand_in`` (made with ``metaclass_for(base)``), give it the original's names,
    and make its instances pickle and copy as the original's (see ``_reducing_as``)."""
    setattr(stand_in, _MARK, True)
    stand_in.__module__ = base.__module__
    stand_in.__qualname__ = base.__qualname__
    stand_in.__name__ = base.__name__
    stand_in.__reduce_ex__ = _reducing_as(stand_in, base)  # type: ignore[method-assign]
    return stand_in


def _reducing_as(stand_in: type, base: type) -> Any:
    """``__reduce_ex__`` that names the original class where the original's would name
    ``type(self)``. A stand-in lives where nondet installed it (``np.random.PCG64``), but
    pickle finds classes by their module (``numpy.random._pcg64``), which holds the
    original: ``pickle.dumps`` and ``copy.deepcopy`` of a ``SeedSequence``, a bit generator,
    a ``Generator`` over one or a ``torch.Generator`` raised "not the same object" in the
    script under nondet only. The copy is an instance of the original, which answers every
    ``isinstance`` check the stand-in does."""

    original: Any = base.__reduce_ex__  # the unbound slot wrapper: (self, protocol)

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        reduced = original(self, protocol)
        # (where the stand-in is what the module holds, ``datetime.datetime``, pickle
        # finds it there: only the original would be "not the same object")
        found = getattr(sys.modules.get(base.__module__), base.__qualname__, None)
        if found is stand_in or not isinstance(reduced, tuple) or len(reduced) < 2:
            return reduced
        make, args, *rest = reduced
        if make is stand_in:
            make = base
        if isinstance(args, tuple):
            args = tuple(base if arg is stand_in else arg for arg in args)
        return (make, args, *rest)

    return __reduce_ex__


#: (owner, attribute, original, stand-in) of every ``install``
_INSTALLED: list[tuple[Any, str, type, type]] = []
_lock = threading.Lock()
_depth = 0  # extension initializations under way (nested, or in several threads)


def install(owner: Any, name: str, stand_in: type) -> None:
    """Put ``stand_in`` at ``owner.name`` for Python code; extension modules imported later
    see the original while they initialize (module docstring)."""
    _INSTALLED.append((owner, name, getattr(owner, name), stand_in))
    setattr(owner, name, stand_in)
    _guard_extension_imports()


_swapped: list[tuple[Any, str, type, type]] = []  # put back by the outermost _enter


def _enter() -> None:
    global _depth
    with _lock:
        if _depth == 0:
            for owner, name, original, stand_in in _INSTALLED:
                if getattr(owner, name, None) is stand_in:
                    setattr(owner, name, original)
                    _swapped.append((owner, name, original, stand_in))
        _depth += 1


def _leave() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            for owner, name, original, stand_in in _swapped:
                if getattr(owner, name, None) is original:  # unless the module set another
                    setattr(owner, name, stand_in)
            _swapped.clear()


def _guard_extension_imports() -> None:
    """Wrap ``ExtensionFileLoader``'s two steps (single-phase modules initialize in
    ``create_module``, multi-phase ones in ``exec_module``), once per process."""
    from importlib.machinery import ExtensionFileLoader

    if getattr(ExtensionFileLoader.create_module, _MARK, False):
        return
    real_create, real_exec = ExtensionFileLoader.create_module, ExtensionFileLoader.exec_module

    def create_module(self: Any, spec: Any) -> Any:
        _enter()
        try:
            return real_create(self, spec)
        finally:
            _leave()

    def exec_module(self: Any, module: Any) -> None:
        _enter()
        try:
            real_exec(self, module)
        finally:
            _leave()

    for wrapper, real in ((create_module, real_create), (exec_module, real_exec)):
        wrapper.__doc__ = real.__doc__
        setattr(wrapper, "__wrapped__", real)  # noqa: B010 (a function has no such field)
        setattr(wrapper, _MARK, True)
    ExtensionFileLoader.create_module = create_module  # type: ignore[method-assign]
    ExtensionFileLoader.exec_module = exec_module  # type: ignore[method-assign]
