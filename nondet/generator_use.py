"""Child side: what became of the unseeded generators libraries made (issue 11 item 5).

A library may make unseeded generators it never draws from: Albumentations 2.x gives every
transform its own ``np.random.default_rng()`` and ``random.Random()``, and ``Compose``
replaces them at once with generators seeded from its own. Listing those as causes buries
the two lines that matter (``Compose``'s own). ``pyhooks`` hands each library generator it
notes to ``GeneratorUse.track``; at every step end the ones nobody but nondet holds any more
are let go, with whether they were ever drawn from (their state moved), and every text's
record is sent as the fact ``library.unseeded_generator.use``:
``{text: {"made": n, "freed": [[step, drawn], ...], "drawn": bool}}``.

``seed_diff.library_generators`` reads it: a generator made and let go without one draw
cannot have fed anything, and generators drawn from in the run come first. A generator
drawn only in forked workers (a DataLoader's) never moves here, so "not drawn" alone
never drops a generator that is still alive.
"""

from __future__ import annotations

import sys
from typing import Any

from nondet.frameworks.base import Session

USE_FACT = "library.unseeded_generator.use"
#: Generators followed per run: a library making one per sample would otherwise grow this.
MAX_TRACKED = 256
#: References to a followed generator when only nondet holds it: ``_Tracked.obj`` and the
#: argument of ``sys.getrefcount``.
_ONLY_OURS = 2


class _Tracked:
    __slots__ = ("obj", "state", "text")

    def __init__(self, obj: Any, text: str) -> None:
        self.obj = obj
        self.text = text
        self.state = _state(obj)


def _state(obj: Any) -> Any:
    """A comparable snapshot of a generator's state (NumPy Generator, RandomState, Random)."""
    bit_generator = getattr(obj, "bit_generator", None)
    if bit_generator is not None:
        return repr(bit_generator.state)
    get_state = getattr(obj, "get_state", None)
    if get_state is not None:  # RandomState: (name, keys array, pos, has_gauss, cached)
        name, keys, *rest = get_state()
        return (name, keys.tobytes(), *rest)
    return obj.getstate()


class GeneratorUse:
    """The library generators of one run, followed until they are let go."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._tracked: list[_Tracked] = []
        self._use: dict[str, dict[str, Any]] = {}
        self._sent = 0  # records sent: a generator followed and never moved has one too
        self.failed = False

    def track(self, obj: Any, text: str) -> None:
        if self.failed or len(self._tracked) >= MAX_TRACKED:
            return
        try:
            self._tracked.append(_Tracked(obj, text))
        except Exception:
            self.failed = True  # a generator type nondet cannot read: no ranking, no harm
            return
        entry = self._use.setdefault(text, {"made": 0, "freed": [], "drawn": False})
        entry["made"] += 1

    def step_ended(self, step: int) -> None:
        """After each step row: let go of generators only nondet holds; note draws."""
        if self.failed or not self._tracked:
            return
        try:
            changed = False
            for tracked in list(self._tracked):
                entry = self._use[tracked.text]
                drawn = _state(tracked.obj) != tracked.state
                if sys.getrefcount(tracked.obj) <= _ONLY_OURS:
                    self._tracked.remove(tracked)
                    entry["freed"].append([step, drawn])
                    changed = True
                if drawn and not entry["drawn"]:
                    entry["drawn"] = changed = True
            if changed or self._sent != len(self._use):
                self._session.send_facts({USE_FACT: self._use})
                self._sent = len(self._use)
        except Exception:
            self.failed = True  # the list of generators is then shown unranked
