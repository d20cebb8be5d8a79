"""Stand-in classes: a subclass that replaces a class nondet cannot patch in place.

C types (``datetime.datetime``, ``np.random.RandomState``, ``torch.Generator``) cannot have
methods replaced, so nondet installs a subclass under the original name. The subclass must
look like the original to the user's code: ``isinstance(x, Original)`` stays true for every
instance of the original, however made (sklearn's ``check_random_state`` relies on it), and
repr and pickling name the original's module.
"""

from __future__ import annotations

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
    """Mark ``stand_in`` (made with ``metaclass_for(base)``) and give it the original's
    names."""
    setattr(stand_in, _MARK, True)
    stand_in.__module__ = base.__module__
    stand_in.__qualname__ = base.__qualname__
    stand_in.__name__ = base.__name__
    return stand_in
