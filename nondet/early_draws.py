"""Random draws a script makes before it seeds the generator they come from.

nondet seeds every run before the script starts (DESIGN.md section 3), so a layer built
(its initializer seeded) or a random op run before the script's own ``set_random_seed``
draws the same values in both runs, while the script run on its own draws new ones each
time: two nondet runs match and two plain runs do not. The child records the first such
draw per kind (with the user's line that led to it) as a fact; ``notes_for`` turns it into
a note when the script does seed that generator later (a script that never seeds at all
gets ``seed_diff``'s "seeds neither" note instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import FrameType
from typing import Any

from nondet import seeding
from nondet import session as session_module
from nondet.frameworks.base import Session

#: Fact key prefix: ``rng.drawn_before_seeding.<kind>`` -> {"site": "train.py:12"}.
FACT_PREFIX = "rng.drawn_before_seeding."


@dataclass(frozen=True)
class Kind:
    """One generator a script can draw from before seeding it."""

    name: str
    what: str  # what was drawn, for the note
    seeds: frozenset[str]  # the seeding APIs (as ``seeding`` records them) that fix it
    #: a script that never seeds it gets a note here too (the other kinds get
    #: ``seed_diff``'s notes for a script that never seeds TensorFlow or Keras)
    never_seeded_note: bool = False
    #: that note's cause and fix
    never_seeded_fix: str = "[PY-ENTROPY]: call random.seed(0) at the start of the script"


#: Keras 3's default seeds come from Python's ``random`` (``make_default_seed``): every
#: layer, initializer and random op made without ``seed=``.
KERAS_DEFAULT = Kind("keras_default_seed", "Keras drew a default seed from Python's random "
                     "(a layer, initializer or random op made without seed=)",
                     frozenset({"random.seed", "keras.utils.set_random_seed"}))
#: TensorFlow's op-level random ops (``tf.random.normal``, ``Dataset.shuffle``, legacy
#: initializers) without ``seed=`` take their seed from the global one.
TF_GLOBAL = Kind("tf_global_seed", "a TensorFlow random op without seed= drew from the "
                 "global seed (tf.random.*, an unseeded shuffle or initializer)",
                 frozenset({"tf.random.set_seed", "keras.utils.set_random_seed"}))
#: Python's global ``random`` drawn by the script's own code (``random.randint`` in a
#: ``Dataset.__getitem__``, a seed drawn with ``random.randint`` before ``random.seed``):
#: draws a library makes on its own are left out (they need not feed training).
PYTHON_GLOBAL = Kind("python_random", "the script draws from Python's random module",
                     frozenset({"random.seed", "keras.utils.set_random_seed"}),
                     never_seeded_note=True)
#: NumPy's global generator (``np.random.permutation``, ``np.random.rand``...) drawn by the
#: script's own code: a script that seeds torch only (or a library it calls, torchsde's
#: Brownian motion) varies with every plain run.
NUMPY_GLOBAL = Kind("numpy_random", "the script draws from NumPy's global random generator "
                    "(np.random.*)",
                    frozenset({"np.random.seed", "np.random.set_state",
                               "keras.utils.set_random_seed"}),
                    never_seeded_note=True,
                    never_seeded_fix="[PY-NP-GENERATOR]: call np.random.seed(0) at the start "
                                     "of the script, or draw from np.random.default_rng(seed)")
KINDS = {kind.name: kind for kind in (KERAS_DEFAULT, TF_GLOBAL, PYTHON_GLOBAL, NUMPY_GLOBAL)}


class EarlyDraws:
    """The child's side: ``drawn`` is called from a draw hook; cheap once seeded."""

    def __init__(self, session: Session, log: seeding.SeedLog) -> None:
        self._session = session
        self._log = log
        self._done: set[str] = set()  # kinds sent, or seeded by the script already

    def done(self, kind: Kind) -> bool:
        """Nothing more to record for ``kind`` (sent, or the script seeded it)."""
        return kind.name in self._done

    def drawn(self, kind: Kind, frame: FrameType | None) -> None:
        """A draw of ``kind`` made from ``frame``. Never raises into the script."""
        if kind.name in self._done:
            return
        try:
            if session_module.current() is not self._session or self._log.disabled:
                return
            if self._log.seeded(kind.seeds):
                self._done.add(kind.name)  # later draws come after the script's seed
                return
            site = self._user_site(frame)
            if site is not None:
                self._done.add(kind.name)
                self._session.send_facts({FACT_PREFIX + kind.name: {"site": site}})
        except Exception:
            self._log.failed()

    def _user_site(self, frame: FrameType | None) -> str | None:
        """The user's line the draw came from; None when nondet drew (its own hashing or
        seeding), when a module being imported drew (a library's import-time layers, below
        the script's ``import`` line), or no user frame is on the stack."""
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if isinstance(name, str) and name.split(".", 1)[0] == "nondet":
                return None
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                return None  # a library drawing while the script imports it: not the script
            if self._log.is_users(frame):
                sid = self._session.sources.intern_location(frame.f_code.co_filename,
                                                            frame.f_lineno)
                return self._session.string(sid)
            frame = frame.f_back
        return None


def first_site(calls: dict[tuple[str, str, str], list[tuple[int, int, str]]],
               apis: frozenset[str]) -> tuple[str, str] | None:
    """(api, site) of the earliest recorded call of one of ``apis`` (``seed_diff.seed_calls``
    form), or None."""
    best: tuple[int, str, str] | None = None
    for (api, site, _), rows in calls.items():
        if api in apis and rows and (best is None or rows[0][0] < best[0]):
            best = (rows[0][0], api, site)
    return None if best is None else (best[1], best[2])


def notes_for(facts: dict[str, Any],
              calls: dict[tuple[str, str, str], list[tuple[int, int, str]]],
              kinds: list[Kind] | None = None) -> list[str]:
    """One note per kind drawn before the script seeded it, when the script seeds it at
    all, or never seeds it (``Kind.never_seeded_note``); ``calls`` is the capture's seeding
    calls (``seed_diff.seed_calls``)."""
    notes = []
    for kind in KINDS.values() if kinds is None else kinds:
        fact = facts.get(FACT_PREFIX + kind.name)
        site = fact.get("site") if isinstance(fact, dict) else None
        seeded = first_site(calls, kind.seeds)
        if isinstance(site, str) and seeded is None and kind.never_seeded_note:
            notes.append(
                f"at {site} {kind.what} and never seeds it: nondet seeded it alike in both "
                "runs (--seed), so these two runs match, but the script run on its own draws "
                "different values there each time (its plain runs differ if they feed "
                f"training) {kind.never_seeded_fix}")
            continue
        if not isinstance(site, str) or seeded is None:
            continue
        api, seed_site = seeded
        notes.append(
            f"at {site} {kind.what} before the script seeds it ({api} at "
            f"{seed_site or 'a library'}): nondet seeded both runs before the script "
            "started, so these two runs match, but the script run on its own draws "
            f"different values there each time: call {api} before {site}")
    return notes
