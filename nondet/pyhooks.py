"""Python- and NumPy-level sources of nondeterminism that no framework hook can see.

Two things are recorded here (torch and TensorFlow have their own ``seeding`` modules):

- where a NumPy ``Generator``/``RandomState`` or a ``random.Random`` is created without a
  seed (such objects ignore the global seeds nondet sets), so that an entry point carrying
  their values can name the line that created them. Made from the user's own code, the
  place goes to ``numpy.unseeded_generator`` / ``python.unseeded_random``; made inside a
  library (Albumentations' ``Compose`` keeps its own), to ``library.unseeded_generator`` as
  "library frame, from user frame", with ``library.unseeded_generator.<package>`` set so a
  recipe can name that library's own seed parameter;
- every seeding call (``random.seed``, ``random.Random(x)``, ``np.random.seed`` (without a
  seed: an unseeded generator, as above),
  ``np.random.default_rng(x)``, ``np.random.RandomState(x)``, and once Keras is imported
  ``keras.utils.set_random_seed``) with its value (``nondet.seeding``).
"""

from __future__ import annotations

import functools
import random
import sys
from types import FrameType
from typing import Any

from nondet import early_draws, frameworks, seeding, standin
from nondet import session as session_module
from nondet.generator_use import GeneratorUse
from nondet.session import Session

#: Fact listing unseeded generators made inside libraries ("lib frame, from user frame").
LIBRARY_UNSEEDED = "library.unseeded_generator"
#: Lines that make a ``random.SystemRandom()`` (the OS's entropy; no seed reaches it).
SYSTEM_RANDOM = "python.system_random"
#: Fact: Keras 3 drew a default seed from Python's ``random`` (a layer, initializer or random
#: op made without ``seed=``), which only ``random.seed`` / ``keras.utils.set_random_seed`` fix.
KERAS_DEFAULT_SEED = "keras.default_seed_from_python"
#: Libraries whose standard-library or framework generators are not the user's concern:
#: ``tempfile`` names files with a ``random.Random()``, frameworks seed from their own RNGs.
_IGNORED_PACKAGES = seeding.FRAMEWORK_PACKAGES | {
    "tempfile", "uuid", "random", "secrets", "multiprocessing", "concurrent", "asyncio",
    "email", "http", "urllib", "logging", "importlib", "_pytest", "pytest", "hypothesis",
}


def install(session: Session) -> None:
    log = seeding.for_session(session)
    sites: dict[str, list[str]] = {}
    stdlib = _stdlib_prefix()

    use = GeneratorUse(session)
    session.step_listeners.append(use.step_ended)

    log.unseeded_sites = sites  # the workers' sites join these lists (collect_workers)

    def note(kind: str, frame: FrameType) -> str | None:
        """An unseeded generator was made by the code of ``frame``; its text if it was made
        inside a library (to follow with ``use.track``)."""
        if session_module.current() is not session:
            # a forked child: its frames must not go down this run's pipe; a DataLoader
            # worker's own generator (one per sample, made in __getitem__) goes to the run's
            # file instead, its line once per worker
            log.worker_unseeded(kind, frame)
            return None
        try:
            package = frame.f_globals.get("__name__", "").split(".", 1)[0]
            if package in _IGNORED_PACKAGES or frame.f_code.co_filename.startswith(stdlib):
                return None
            where = log.call_site(frame)
            if where is None or not (where.site or where.library):
                return None
            if where.library and _made_for_someone_else(log, frame):
                return None
            if where.library:
                fact, text = LIBRARY_UNSEEDED, f"{where.library} in {where.package}"
                text += f", made from {where.site}" if where.site else ""
            else:
                fact, text = kind, where.site
            seen = sites.setdefault(fact, [])
            if text not in seen and len(seen) < 64:
                seen.append(text)
                facts: dict[str, Any] = {fact: seen}
                if where.library:
                    facts[f"{LIBRARY_UNSEEDED}.{where.package}"] = True
                session.send_facts(facts)
            return text if where.library else None
        except Exception:
            log.failed()
            return None

    import numpy as np

    original_default_rng = np.random.default_rng

    def default_rng(seed: Any = None) -> Any:
        text = note("numpy.unseeded_generator", sys._getframe(2)) if seed is None else None
        generator = original_default_rng(seed)
        if text is not None:
            use.track(generator, text)
        return generator

    np.random.default_rng = log.wrap("np.random.default_rng", default_rng, seeding.first_arg)
    original_np_seed = np.random.seed

    def np_seed(seed: Any = None) -> None:
        if seed is None:  # reseeds the global RandomState from fresh entropy
            note("numpy.unseeded_generator", sys._getframe(2))
        original_np_seed(seed)

    np.random.seed = log.wrap("np.random.seed", np_seed, seeding.first_arg)
    original_set_state = np.random.set_state

    def set_state(state: Any, *args: Any, **kwargs: Any) -> Any:
        # Setting the global state is taking charge of it, as seeding is: ctgan's
        # ``@random_state`` sets the state of its ``set_random_state(0)`` generator around
        # every ``fit``, and the script got "draws from NumPy's global generator and never
        # seeds it" (trial round 20). Recorded as a digest of the state, never pinned (the
        # pin fix gives seeding calls an int; this call's argument is a whole state).
        if not log.nested():
            log.record("np.random.set_state", _state_digest(state), sys._getframe(1))
        return original_set_state(state, *args, **kwargs)

    np.random.set_state = functools.wraps(original_set_state)(set_state)
    standin.install(np.random, "RandomState", _recording_random_state(log, note, use))
    standin.install(np.random, "SeedSequence", _noting_seed_sequence(log, note))
    for name in _BIT_GENERATORS:
        if isinstance(getattr(np.random, name, None), type):
            standin.install(np.random, name, _noting_bit_generator(log, note, name))

    original_random_init = random.Random.__init__

    def random_init(self: random.Random, x: Any = None) -> None:
        text = None
        if not log.nested():
            caller = sys._getframe(1)
            if x is None:  # SystemRandom reads the OS and ignores seeds: its own cause
                text = note(SYSTEM_RANDOM if isinstance(self, random.SystemRandom)
                            else "python.unseeded_random", caller)
            elif type(self) is not random.SystemRandom:
                if seeding.PINNED is not None:  # the pin_seeds fix reaches instances too
                    (x,), _ = log.pinned((x,), {}, caller)
                log.record("random.Random", x, caller)
        original_random_init(self, x)
        if text is not None:
            use.track(self, text)

    random.Random.__init__ = random_init  # type: ignore[method-assign]

    original_seed = random.seed

    def seed(a: Any = None, version: int = 2) -> None:
        if a is None:
            note("python.unseeded_random", sys._getframe(2))
        original_seed(a, version)

    random.seed = log.wrap("random.seed", seed, lambda a=None, *_, **__: a)
    _watch_python_draws(session, log)
    _watch_numpy_draws(session, log)
    frameworks.after_import("keras", lambda: _wrap_keras_seed(log, "keras"))
    frameworks.after_import("tf_keras", lambda: _wrap_keras_seed(log, "tf_keras"))
    frameworks.after_import("keras", lambda: _note_keras_default_seeds(session, log))


#: The ``random`` module's functions that draw from its global generator.
_PYTHON_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle",
                 "sample", "gauss", "normalvariate", "getrandbits", "randbytes", "triangular",
                 "betavariate", "expovariate", "gammavariate", "lognormvariate",
                 "paretovariate", "vonmisesvariate", "weibullvariate", "binomialvariate")


#: NumPy's module functions that draw from its global generator (``np.random.mtrand._rand``).
_NUMPY_DRAWS = ("rand", "randn", "randint", "random", "random_sample", "ranf", "sample",
                "choice", "permutation", "shuffle", "normal", "uniform", "standard_normal",
                "binomial", "poisson", "exponential", "beta", "gamma", "laplace", "logistic",
                "lognormal", "multinomial", "multivariate_normal", "dirichlet", "bytes",
                "random_integers", "standard_cauchy", "standard_t", "geometric")


def _watch_python_draws(session: Session, log: seeding.SeedLog) -> None:
    """The first draw the script's own code makes from Python's global ``random`` before
    seeding it (``early_draws.PYTHON_GLOBAL``): nondet seeds that generator in both runs,
    so they repeat where plain runs draw fresh values. Once recorded, or once the script
    has seeded it, the module's functions are nondet's no longer (a name imported
    earlier with ``from random import`` keeps a wrapper that only checks a set). A
    library's own draws are left out: they need not feed training."""
    _watch_draws(session, log, random, _PYTHON_DRAWS, early_draws.PYTHON_GLOBAL,
                 script_only=True)


def _watch_numpy_draws(session: Session, log: seeding.SeedLog) -> None:
    """The same for NumPy's global generator (``early_draws.NUMPY_GLOBAL``), whoever draws
    while the script's code runs: a library's draws there feed training as often as not
    (torchsde's Brownian motion, Keras' shuffle of array data)."""
    import numpy as np

    _watch_draws(session, log, np.random, _NUMPY_DRAWS, early_draws.NUMPY_GLOBAL,
                 script_only=False)


def _watch_draws(session: Session, log: seeding.SeedLog, module: Any, names: tuple[str, ...],
                 kind: early_draws.Kind, script_only: bool) -> None:
    """Wrap ``module``'s drawing functions ``names`` to record the first draw of ``kind``
    (see ``_watch_python_draws``); ``script_only``: only the script's own calls count."""
    early = early_draws.EarlyDraws(session, log)
    originals = {name: getattr(module, name) for name in names
                 if callable(getattr(module, name, None))}
    wrappers: dict[str, Any] = {}

    def restore() -> None:
        for name, original in originals.items():
            if getattr(module, name, None) is wrappers.get(name):
                setattr(module, name, original)

    def watched(original: Any) -> Any:
        def draw(*args: Any, **kwargs: Any) -> Any:
            if not early.done(kind):
                caller = sys._getframe(1)
                try:
                    counts = log.is_users(caller) if script_only else True
                except Exception:
                    log.failed()
                    counts = False
                if counts:
                    early.drawn(kind, caller)
                if early.done(kind):
                    restore()
            return original(*args, **kwargs)

        draw.__wrapped__ = original  # type: ignore[attr-defined]
        draw.__doc__, draw.__name__ = original.__doc__, original.__name__
        return draw

    for name, original in originals.items():
        wrappers[name] = watched(original)
        setattr(module, name, wrappers[name])


#: Where each Keras defines ``set_random_seed``; every module exporting it imports it from
#: there (``keras.utils``, ``keras._tf_keras.keras.utils``, ``tf_keras.utils``,
#: ``tf_keras.api._v2.keras.utils``, which is ``tf.keras.utils`` under
#: ``TF_USE_LEGACY_KERAS=1``, ...).
KERAS_SEED_SOURCES = {"keras": "keras.src.utils.rng_utils",
                      "tf_keras": "tf_keras.src.utils.tf_utils"}
_KERAS_SEED_WRAPPED = "_nondet_records_seed"


def _wrap_keras_seed(log: seeding.SeedLog, package: str) -> None:
    """``keras.utils.set_random_seed`` seeds Python, NumPy and its backend (TensorFlow,
    torch or JAX) from Keras' own code, whose calls are not recorded: the user's call is.
    Here, not in a framework backend: Keras on torch may never import TensorFlow. Keras 2
    (``tf_keras``) has the same function. Wrapped where it is defined and in every module
    already holding it (read from their ``__dict__``: a lazy module's ``__getattr__``
    would import), so an exporting module imported later (TensorFlow imports
    ``tf.keras``'s on first use) takes the wrapped one."""
    source = sys.modules.get(KERAS_SEED_SOURCES[package])
    original = getattr(source, "set_random_seed", None)
    if source is None or original is None or getattr(original, _KERAS_SEED_WRAPPED, False):
        return
    wrapped = log.wrap("keras.utils.set_random_seed", original, seeding.first_arg)
    setattr(wrapped, _KERAS_SEED_WRAPPED, True)
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("set_random_seed") is original:
            module.set_random_seed = wrapped  # type: ignore[attr-defined]


def _note_keras_default_seeds(session: Session, log: seeding.SeedLog) -> None:
    """Keras 3 seeds every layer, initializer and random op made without ``seed=`` from
    Python's ``random`` (``make_default_seed``): the first such draw is a fact, so a script
    that seeds only TensorFlow is told it still varies on its own (``seed_diff``)."""
    original = getattr(sys.modules.get("keras.src.random.seed_generator"),
                       "make_default_seed", None)
    if original is None:
        return
    sent = [False]
    early = early_draws.EarlyDraws(session, log)

    def make_default_seed() -> Any:
        if not sent[0] and session_module.current() is session:
            sent[0] = True
            try:
                session.send_facts({KERAS_DEFAULT_SEED: True})
            except Exception:
                log.failed()
        early.drawn(early_draws.KERAS_DEFAULT, sys._getframe(1))
        return original()

    # imported by name into each backend's random module too: replace every reference
    for name, module in list(sys.modules.items()):
        if name.startswith("keras.src") and getattr(module, "make_default_seed", None) \
                is original:
            setattr(module, "make_default_seed", make_default_seed)  # noqa: B010


def _made_for_someone_else(log: seeding.SeedLog, frame: FrameType) -> bool:
    """A library's generator the user did not ask for: made while a framework's code runs
    (torch imports sympy, which keeps ``random.Random()`` objects), or while a module that
    another library imports is executed. Neither feeds the user's data."""
    importer = None
    walk: FrameType | None = frame
    while walk is not None and not log.is_users(walk):
        name = walk.f_globals.get("__name__", "")
        if isinstance(name, str) and name.split(".", 1)[0] in seeding.FRAMEWORK_PACKAGES:
            return True
        if walk.f_code.co_filename.startswith("<frozen importlib"):
            importer = walk.f_back  # the outermost import on the way up wins
        walk = walk.f_back
    while importer is not None and importer.f_code.co_filename.startswith("<frozen importlib"):
        importer = importer.f_back
    return importer is not None and not log.is_users(importer)


def _recording_random_state(log: seeding.SeedLog, note: Any, use: GeneratorUse) -> type:
    """``np.random.RandomState`` that records its seed. A C type cannot be patched, so this
    is a subclass; its metaclass keeps ``isinstance(x, np.random.RandomState)`` true for
    every RandomState, however made (sklearn's ``check_random_state`` relies on it), and
    pickles name numpy's own constructor."""
    import numpy as np

    base = np.random.RandomState

    meta = standin.metaclass_for(base)

    class RandomState(base, metaclass=meta):  # type: ignore[misc,valid-type,metaclass]
        __slots__ = ()  # the C layout of RandomState (standin module docstring)

        def __init__(self, seed: Any = None) -> None:
            text = None
            if not log.nested():
                caller = sys._getframe(1)
                if seed is None:
                    text = note("numpy.unseeded_generator", caller)
                else:
                    if seeding.PINNED is not None:  # as random.Random(x) above
                        (seed,), _ = log.pinned((seed,), {}, caller)
                    log.record("np.random.RandomState", seed, caller)
            super().__init__(seed)
            if text is not None:
                use.track(self, text)

    return standin.finish(RandomState, base)


def _noting_seed_sequence(log: seeding.SeedLog, note: Any) -> type:
    """``np.random.SeedSequence`` that notes where it is made without entropy and records
    the seed it is made with: libraries build their generators from one in Python
    (gymnasium's ``seeding.np_random(seed)``, behind ``env.reset(seed=...)`` and every
    action space's ``sample()``). A clock value given to ``env.reset(seed=...)`` got the
    OpenCV recipe, the seed never seen. (numpy's own ``default_rng(n)`` makes its
    sequence in C, unseen here: that call is recorded as itself.)"""
    import numpy as np

    base = np.random.SeedSequence
    meta = standin.metaclass_for(base)

    class SeedSequence(base, metaclass=meta):  # type: ignore[misc,valid-type,metaclass]
        __slots__ = ()  # the C layout of SeedSequence (standin module docstring)

        def __init__(self, entropy: Any = None, **kwargs: Any) -> None:
            if not log.nested():
                caller = sys._getframe(1)
                if entropy is None:
                    note("numpy.unseeded_generator", caller)
                else:
                    if seeding.PINNED is not None:  # as random.Random(x)
                        (entropy,), _ = log.pinned((entropy,), {}, caller)
                    log.record("np.random.SeedSequence", entropy, caller)
            super().__init__(entropy, **kwargs)

    return standin.finish(SeedSequence, base)


#: NumPy's bit generators, which a script may seed directly
#: (``np.random.Generator(np.random.PCG64(seed))``); they make their SeedSequence in C.
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def _noting_bit_generator(log: seeding.SeedLog, note: Any, name: str) -> type:
    """``np.random.PCG64`` (and the other bit generators) recording the seed it is made
    with, as ``SeedSequence`` does: ``Generator(PCG64(int(time.time())))`` drew different
    numbers in each run and the value they made got the OpenCV recipe, the seed never
    seen (trial round 16). A SeedSequence or another bit generator's state given as the
    seed was recorded where it was made; no seed at all reads the OS: a note."""
    import numpy as np

    base = getattr(np.random, name)
    meta = standin.metaclass_for(base)
    given = np.random.SeedSequence  # (nondet's stand-in: an instance of the original too)

    class BitGenerator(base, metaclass=meta):  # type: ignore[misc,valid-type,metaclass]
        __slots__ = ()  # the C layout of the bit generator (standin module docstring)

        def __init__(self, seed: Any = None, *args: Any, **kwargs: Any) -> None:
            if not log.nested():
                caller = sys._getframe(1)
                if seed is None:
                    note("numpy.unseeded_generator", caller)
                elif not isinstance(seed, given):
                    if seeding.PINNED is not None:  # as random.Random(x)
                        (seed,), _ = log.pinned((seed,), {}, caller)
                    log.record(f"np.random.{name}", seed, caller)
            super().__init__(seed, *args, **kwargs)

    return standin.finish(BitGenerator, base)


def _stdlib_prefix() -> str:
    import os
    import sysconfig

    return os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep


def _state_digest(state: Any) -> int | None:
    """A 64-bit digest of a NumPy global state as ``np.random.set_state`` takes it (the
    legacy tuple or a bit generator's dict), the same for the same state in every run;
    None where it cannot be read (the call's own error, not nondet's)."""
    try:
        import hashlib
        import pickle

        digest = hashlib.blake2b(pickle.dumps(state, protocol=4), digest_size=8).digest()
        return int.from_bytes(digest, "little")
    except Exception:
        return None
