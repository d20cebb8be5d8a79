"""torch's seeding calls, recorded with their values (``nondet.seeding``).

``torch.manual_seed``, ``torch.cuda.manual_seed(_all)`` (module functions, replaced) and
``torch.Generator(...).manual_seed``; ``torch.seed()`` and ``Generator.seed()``, which draw
a seed from the OS, with the seed they drew (the runs' differ: the call is named).
``torch.Generator`` is a C type whose methods cannot be
replaced, so ``torch.Generator`` becomes a subclass that records ``manual_seed``; its
metaclass keeps ``isinstance(g, torch.Generator)`` true for every generator (the default
one included), and pickles still name ``torch.Generator``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from nondet import seeding, standin
from nondet.frameworks.base import Session


def install(session: Session) -> None:
    log = seeding.for_session(session)
    for owner, name, api in ((torch, "manual_seed", "torch.manual_seed"),
                             (torch.random, "manual_seed", "torch.manual_seed"),
                             (torch.cuda, "manual_seed", "torch.cuda.manual_seed"),
                             (torch.cuda, "manual_seed_all", "torch.cuda.manual_seed_all")):
        original = getattr(owner, name, None)
        if original is not None:
            setattr(owner, name, log.wrap(api, original, seeding.first_arg))
    # ``torch.seed()`` seeds every device with a seed drawn from the OS and returns it
    manual_seed = torch.manual_seed
    for owner in (torch, torch.random):
        setattr(owner, "seed", log.wrap_drawn(  # noqa: B010 - two modules, one function
            "torch.seed", torch.random.seed, lambda pin: (manual_seed(pin), pin)[1]))
    standin.install(torch, "Generator", _recording_generator(log))


def _recording_generator(log: seeding.SeedLog) -> type:
    base = torch.Generator

    meta = standin.metaclass_for(base)

    class Generator(base, metaclass=meta):  # type: ignore[misc,valid-type,metaclass]
        __slots__ = ()  # the C layout of torch.Generator (standin module docstring)

        def manual_seed(self, seed: Any) -> Any:
            if not log.nested():
                caller = sys._getframe(1)
                if seeding.PINNED is not None:  # the pin_seeds fix, as for torch.manual_seed
                    (seed,), _ = log.pinned((seed,), {}, caller)
                log.record("torch.Generator.manual_seed", seed, caller)
            return super().manual_seed(seed)

        def seed(self) -> int:
            """A seed drawn from the OS, recorded as ``torch.seed()``'s is."""
            def pinned(pin: int) -> int:
                super(Generator, self).manual_seed(pin)
                return pin
            return int(log.drawn("torch.Generator.seed", super().seed, pinned,
                                 sys._getframe(1)))

    return standin.finish(Generator, base)
