"""Python- and NumPy-level sources of nondeterminism that no framework hook can see.

Records where user code creates a NumPy ``Generator`` or a ``random.Random`` without a seed
(such objects ignore the global seeds nondet sets), so an entry point that carries their
values can name the line that created them. Only calls made directly from user files count.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from nondet.session import Session


def install(session: Session) -> None:
    sites: dict[str, list[str]] = {}

    def note(kind: str) -> None:
        where = session.sources.direct_caller(depth=3)
        if where is None:
            return
        seen = sites.setdefault(kind, [])
        if where not in seen:
            seen.append(where)
            session.send_facts({kind: seen})

    import numpy as np

    original_default_rng = np.random.default_rng

    @functools.wraps(original_default_rng)
    def default_rng(seed: Any = None) -> Any:
        if seed is None:
            note("numpy.unseeded_generator")
        return original_default_rng(seed)

    np.random.default_rng = default_rng

    original_random_init = random.Random.__init__

    def random_init(self: random.Random, x: Any = None) -> None:
        if x is None:
            note("python.unseeded_random")
        original_random_init(self, x)

    random.Random.__init__ = random_init  # type: ignore[method-assign]

    original_seed = random.seed

    @functools.wraps(original_seed)
    def seed(a: Any = None, version: int = 2) -> None:
        if a is None:
            note("python.unseeded_random")
        original_seed(a, version)

    random.seed = seed
