"""TensorFlow's and Keras' seeding calls, recorded with their values (``nondet.seeding``).

``tf.random.set_seed`` (and its ``tf.compat.v1`` names) and ``tf.random.Generator.from_seed``.
``keras.utils.set_random_seed`` is recorded by ``nondet.pyhooks`` (Keras may run on torch).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import tensorflow as tf

from nondet import early_draws, seeding
from nondet.frameworks.base import Session


def install(session: Session) -> None:
    log = seeding.for_session(session)
    set_seed = log.wrap("tf.random.set_seed", tf.random.set_seed, seeding.first_arg)
    tf.random.set_seed = set_seed
    compat = getattr(getattr(tf, "compat", None), "v1", None)
    for owner, name in ((compat, "set_random_seed"),
                        (getattr(compat, "random", None), "set_random_seed")):
        if owner is not None and hasattr(owner, name):
            setattr(owner, name, log.wrap("tf.random.set_seed", getattr(owner, name),
                                          seeding.first_arg))

    from tensorflow.python.ops import stateful_random_ops

    generator = stateful_random_ops.Generator
    original_from_seed = generator.from_seed.__func__

    def from_seed(cls: type, seed: Any, alg: Any = None) -> Any:
        if not log.nested():
            caller = sys._getframe(1)
            if seeding.PINNED is not None:  # the pin_seeds fix, as for tf.random.set_seed
                (seed,), _ = log.pinned((seed,), {}, caller)
            log.record("tf.random.Generator.from_seed", seed, caller)
        return original_from_seed(cls, seed, alg)

    generator.from_seed = classmethod(from_seed)
    _note_early_draws(session, log)


def _note_early_draws(session: Session, log: seeding.SeedLog) -> None:
    """A random op without ``seed=`` run before the script's ``tf.random.set_seed``
    (``early_draws``). Ops look ``random_seed.get_seed`` up on the module at each call."""
    from tensorflow.python.framework import random_seed

    original = random_seed.get_seed
    early = early_draws.EarlyDraws(session, log)

    @functools.wraps(original)
    def get_seed(op_seed: Any) -> Any:
        if op_seed is None:
            early.drawn(early_draws.TF_GLOBAL, sys._getframe(1))
        return original(op_seed)

    random_seed.get_seed = get_seed
