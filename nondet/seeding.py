"""Seeding calls, recorded in the captured run so that the parent can compare their values.

A script that seeds from the clock, the pid, ``os.urandom`` or a ``uuid`` seeds each run
differently. Comparing the values every seeding call received (``seed_diff``, parent side)
names that call's line, instead of the first op that consumed the difference.

Each call site is one fact, ``seed#N`` (``SEED_FACT_PREFIX``), re-sent as it grows::

    {"api": "torch.manual_seed", "site": "train.py:12", "library": "", "package": "",
     "calls": [[seq, step, "1795454799"], ...]}

``site`` is the first frame in the user's own files, ``library`` the frame that made the
call when it is not the user's (a library's ``seed_everything``), ``seq`` a run-wide call
counter (which difference came first). Values that are not plain numbers are fingerprinted
(bytes, strings, arrays, a ``SeedSequence``); an object of any other type is recorded by its
type only, so it never differs: its ``repr`` may hold an address, and a false alarm is worse
than a miss.

Not recorded: calls made by nondet itself (the run's own seeds), calls made by the
frameworks' own code (a DataLoader sampler seeding its generator from the torch RNG, Keras'
seed generators: those values follow RNG state the step records already cover) unless the
seed is a clock reading the user's code made (``SobolEngine(seed=int(time.time()))``,
PowerSGD's ``random_seed=time.time_ns()``: the framework seeds with the user's number, which
no RNG state covers; the site is then the user's line that called into the framework), seeding
calls nested inside another recorded one (``keras.utils.set_random_seed`` seeds four RNGs).
Calls in forked workers (DataLoader workers cannot write to the run's pipe) go to a file of
the run's that the run reads at its end (``worker_seeds``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, TypeVar

import numpy as np

from nondet import channel, clock, own_os, worker_seeds
from nondet import session as session_module
from nondet.frameworks.base import Session

SEED_FACT_PREFIX = "seed#"
#: Values kept per call site (a dataset seeding per sample repeats one site many times).
MAX_CALLS_PER_SITE = 32
#: Call sites kept per run.
MAX_SITES = 256
#: Packages whose own seeding calls derive from framework RNG state (see module docstring).
FRAMEWORK_PACKAGES = frozenset({"nondet", "torch", "tensorflow", "keras", "tf_keras", "numpy",
                                "jax", "jaxlib"})

F = TypeVar("F", bound=Callable[..., Any])

#: Set by the ``seeding.pin_seeds`` intervention (``nondet.interventions``): every seeding
#: call from outside the frameworks then receives this base plus its call number instead of
#: the number it was given (a seed read from the clock included), so a fix for a varying
#: seed can be verified without editing the script.
PINNED: int | None = None


@dataclass(frozen=True)
class CallSite:
    """Where a call came from: the user's line, and the library frame in between if any."""

    site: str  # first user frame, "train.py:12" ("" if there is none)
    library: str  # the calling frame when it is not the user's ("" if it is)
    package: str  # top-level package of ``library`` ("" for the user's own calls)


#: Longer integer seeds are shown by digest: Python's str() of an int over 4300 digits
#: raises (``random.seed(10**5000)`` made nondet exit 3).
_LONGEST_SEED_BITS = 4096


def seed_value(value: Any) -> str:
    """A seed as comparable text: numbers as themselves, other seeds fingerprinted, objects
    of unknown types by type name only (never by ``repr``, which may hold an address)."""
    if isinstance(value, bool | int | np.integer):
        number = int(value)
        if number.bit_length() > _LONGEST_SEED_BITS:  # str() refuses over 4300 digits
            raw = number.to_bytes((number.bit_length() + 8) // 8, "little", signed=True)
            return f"int:{_digest(raw)}"
        return str(number)
    if isinstance(value, float | np.floating):
        return repr(float(value))
    if isinstance(value, str):
        return f"str:{_digest(value.encode('utf-8', 'surrogatepass'))}"
    if isinstance(value, bytes | bytearray | memoryview):
        return f"bytes:{_digest(bytes(value))}"
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        raw = f"{value.dtype.str}{value.shape}".encode() + np.ascontiguousarray(value).tobytes()
        return f"array:{_digest(raw)}"
    if isinstance(value, list | tuple) and all(isinstance(v, int | np.integer) for v in value):
        numbers = [int(v) for v in value]
        if any(n.bit_length() > _LONGEST_SEED_BITS for n in numbers):
            return f"ints:{_digest(' '.join(seed_value(n) for n in numbers).encode())}"
        return f"ints:{_digest(repr(numbers).encode())}"
    if isinstance(value, np.random.SeedSequence):
        entropy: Any = value.entropy
        if isinstance(entropy, int) and entropy.bit_length() > _LONGEST_SEED_BITS:
            entropy = seed_value(entropy)  # repr() refuses it too
        return f"SeedSequence:{_digest(repr((entropy, value.spawn_key)).encode())}"
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        # a 0-d tensor: its number (item() of a 0-d tensor is cheap and cannot change it)
        try:
            return seed_value(value.item())
        except Exception:
            pass
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class SeedLog:
    """The run's record of seeding calls (one per session; see ``for_session``)."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._sites: dict[tuple[str, str, str], tuple[str, dict[str, Any]]] = {}
        self._seq = 0
        self._local = threading.local()  # nesting depth of recorded calls, per thread
        self._users: dict[CodeType, bool] = {}  # is_users per code object (a dataset may
        # seed once per sample: the walk stays a few dict lookups)
        self.disabled = False
        self._pins = 0  # seeding calls pinned so far (see PINNED)
        self._pid = own_os.getpid()  # another pid with no session: a forked worker
        #: unseeded generators' sites by fact (pyhooks), which the workers' join
        self.unseeded_sites: dict[str, list[str]] = {}
        self._worker_unseeded: set[tuple[str, CodeType, int]] = set()  # written, per worker
        script = getattr(session.config, "script", None)
        self._root = os.path.realpath(os.path.dirname(os.path.abspath(script)) if script
                                      else os.getcwd()) + os.sep

    # -- where a call comes from -------------------------------------------------------------
    def call_site(self, frame: FrameType, seed: Any = None) -> CallSite | None:
        """The call site of a call made from ``frame`` (the caller of a hooked function)
        with ``seed``; None when nondet made the call, or a framework did with a seed that
        is not a clock reading of the user's (see module docstring)."""
        package = _package(frame)
        if package == "nondet" or (package in FRAMEWORK_PACKAGES
                                   and clock.origin_of(seed) is None):
            return None
        library = "" if self.is_users(frame) else self._library_frame(frame, package)
        user: FrameType | None = frame
        fallback = None
        while user is not None and not self.is_users(user):
            if fallback is None and self._session.sources.user_file(user.f_code.co_filename):
                fallback = user
            user = user.f_back
        user = user or fallback
        site = ""
        if user is not None:
            sid = self._session.sources.intern_location(user.f_code.co_filename, user.f_lineno)
            site = self._session.string(sid)
        return CallSite(site=site, library=library, package=package if library else "")

    def is_users(self, frame: FrameType) -> bool:
        """A frame of the user's own code: a user file under the script's directory (a
        package elsewhere, installed or not, is a library the script uses)."""
        code = frame.f_code
        users = self._users.get(code)
        if users is None:
            filename = code.co_filename
            users = self._users[code] = self._session.sources.user_file(filename) and \
                os.path.realpath(filename).startswith(self._root)
        return users

    def step(self) -> int:
        """The run's step counter (in a forked worker: as it was at the fork)."""
        return int(self._session.step)

    def library_frame(self, frame: FrameType, package: str) -> str:
        return self._library_frame(frame, package)

    @staticmethod
    def _library_frame(frame: FrameType, package: str) -> str:
        """"albumentations/core/composition.py:171": the path from the package's folder."""
        path = frame.f_code.co_filename
        marker = f"{os.sep}{package}{os.sep}"
        cut = path.rfind(marker)
        shown = path[cut + 1:] if package and cut >= 0 else os.path.basename(path)
        return f"{shown}:{frame.f_lineno}"

    # -- recording -----------------------------------------------------------------------------
    def worker_unseeded(self, kind: str, frame: FrameType) -> None:
        """A forked worker made an unseeded generator (``kind``: the pyhooks fact) in the
        user's own code at ``frame``: a line in the run's worker file, once per site and
        worker. Never raises."""
        try:
            path = worker_seeds.path_for(self._session)
            key = (kind, frame.f_code, frame.f_lineno)
            if (self.disabled or not path or session_module.current() is not None
                    or own_os.getpid() == self._pid or key in self._worker_unseeded
                    or not self.is_users(frame)):
                return
            self._worker_unseeded.add(key)
            worker_seeds.note(self, path, kind, None, frame, "", "")
        except Exception:
            pass  # a worker has no way to report nondet's trouble: the site goes unnamed

    def record(self, api: str, value: Any, frame: FrameType) -> None:
        """One seeding call (``frame`` made it). Never raises into the script."""
        if self.disabled or value is None:
            return  # None: no seed (fresh entropy), noted by pyhooks as an unseeded RNG
        current = session_module.current()
        if current is not self._session:
            # Another session (a recorded child's) or none: a forked child, whose frames
            # must not go down our pipe; a worker's call goes to the run's file instead.
            path = worker_seeds.path_for(self._session)
            if current is None and path and own_os.getpid() != self._pid:
                package = _package(frame)
                if package not in FRAMEWORK_PACKAGES:
                    worker_seeds.note(self, path, api, value, frame, _safe_text(value),
                                      package)
            return
        try:
            where = self.call_site(frame, value)
            if where is None:
                return
            key = (api, where.site, where.library)
            entry = self._sites.get(key)
            if entry is None:
                if len(self._sites) >= MAX_SITES:
                    return
                entry = self._sites[key] = (
                    f"{SEED_FACT_PREFIX}{len(self._sites)}",
                    {"api": api, "site": where.site, "library": where.library,
                     "package": where.package, "calls": []})
            fact, data = entry
            if len(data["calls"]) >= MAX_CALLS_PER_SITE:
                return
            self._seq += 1
            data["calls"].append([self._seq, int(self._session.step), seed_value(value)])
            if "clock" not in data:
                self._note_clock(data, value)
            self._session.send_facts({fact: data})
        except Exception:
            self.failed()

    def _note_clock(self, data: dict[str, Any], value: Any) -> None:
        """The seed equals a reading of the clock the user's code made: name that line
        (``{"site": "train.py:5", "how": "ms % 4294967296"}``)."""
        origin = clock.origin_of(value)
        if origin is not None:
            filename, line, how = origin
            sid = self._session.sources.intern_location(filename, line)  # its text goes too
            data["clock"] = {"site": self._session.string(sid), "how": how}

    def failed(self) -> None:
        """nondet's own error: reported once as a nondet bug (exit 3); recording stops and
        the script runs on."""
        if not self.disabled:
            self.disabled = True
            with contextlib.suppress(Exception):  # the report itself must not reach the script
                self._session.send_meta({channel.META_HOOK_ERROR: traceback.format_exc()})

    def wrap(self, api: str, function: F, seed_of: Callable[..., Any]) -> F:
        """``function`` recording its seed (``seed_of(*args, **kwargs)``) before it runs.
        Seeding calls it makes itself are not recorded again."""
        log = self

        @functools.wraps(function)
        def seeding(*args: Any, **kwargs: Any) -> Any:
            if not getattr(log._local, "depth", 0):
                if PINNED is not None:
                    args, kwargs = log.pinned(args, kwargs, sys._getframe(1))
                log.record(api, _safe_seed(seed_of, args, kwargs), sys._getframe(1))
            log._local.depth = getattr(log._local, "depth", 0) + 1
            try:
                return function(*args, **kwargs)
            finally:
                log._local.depth -= 1

        return seeding  # type: ignore[return-value]

    def wrap_drawn(self, api: str, function: F, seed_with: Callable[[int], Any]) -> F:
        """``function`` that seeds with a seed it draws itself and returns it
        (``torch.seed()``): see ``drawn``."""
        log = self

        @functools.wraps(function)
        def drawn(*args: Any, **kwargs: Any) -> Any:
            return log.drawn(api, lambda: function(*args, **kwargs), seed_with,
                             sys._getframe(1))

        return drawn  # type: ignore[return-value]

    def drawn(self, api: str, draw: Callable[[], Any], seed_with: Callable[[int], Any],
              frame: FrameType) -> Any:
        """A call from ``frame`` that seeds with a seed it draws itself and returns it
        (``torch.seed()``, ``Generator.seed()``): the seed is recorded after it runs, so a
        script that draws one gets that call named where the runs' seeds differ. Under the
        pin_seeds fix it seeds with ``seed_with(pinned)`` instead."""
        if getattr(self._local, "depth", 0):
            return draw()
        pin = self.next_pin(frame) if PINNED is not None else None
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            value = draw() if pin is None else seed_with(pin)
        finally:
            self._local.depth -= 1
        self.record(api, value, frame)
        return value

    def next_pin(self, frame: FrameType, seed: Any = None) -> int | None:
        """The next pinned seed for a call from ``frame`` in place of ``seed`` (``PINNED``,
        in a DataLoader worker the worker's own seed, plus the call number), None for calls
        that are not recorded (``call_site``) or without the pin_seeds fix."""
        if PINNED is None or self.call_site(frame, seed) is None:
            return None
        # a DataLoader worker seeds from the seed torch gave it, as the fix says: one pinned
        # constant would give every worker the same stream (DATA-PT-WORKER-SEED-VARIES)
        worker = worker_seeds.loader_worker_seed() if own_os.getpid() != self._pid else None
        value = ((PINNED if worker is None else worker) + self._pins) % 2**31
        self._pins += 1
        return value

    def pinned(self, args: tuple[Any, ...], kwargs: dict[str, Any], frame: FrameType,
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with a plain-number seed replaced by ``PINNED`` plus the call
        number (calls the frameworks make themselves keep theirs). Never raises: on any
        trouble the arguments are returned as they were."""
        try:
            def number(x: Any) -> bool:
                return isinstance(x, int | float) and not isinstance(x, bool)
            if args and number(args[0]):
                value = self.next_pin(frame, args[0])
                if value is not None:
                    return (type(args[0])(value), *args[1:]), kwargs
            elif number(kwargs.get("seed")):
                value = self.next_pin(frame, kwargs["seed"])
                if value is not None:
                    return args, {**kwargs, "seed": type(kwargs["seed"])(value)}
        except Exception:
            self.failed()
        return args, kwargs

    def seeded(self, apis: frozenset[str]) -> bool:
        """The script (or a library it called) made one of the seeding calls ``apis``."""
        return any(api in apis for api, _, _ in self._sites)

    def nested(self) -> bool:
        """Inside a recorded seeding call (its own seeding calls are not recorded again)."""
        return bool(getattr(self._local, "depth", 0))


def _safe_text(value: Any) -> str:
    try:
        return seed_value(value)
    except Exception:
        return f"<{type(value).__qualname__}>"


def collect_workers(session: Session) -> None:
    """At the run's end: the seeding calls its forked workers made, as facts (never
    raises: trouble is nondet's, reported once)."""
    log = _LOG
    if log is None or log._session is not session or log.disabled:
        return
    try:
        facts = worker_seeds.collect(session, log._seq, SEED_FACT_PREFIX)
        for kind in worker_seeds.UNSEEDED_KINDS:
            made = facts.pop(kind, None)
            if made:  # with the main process's own sites of that kind
                sites = log.unseeded_sites.setdefault(kind, [])
                sites.extend(site for site in made if site not in sites)
                facts[kind] = sites[:64]
        if facts:
            session.send_facts(facts)
    except Exception:
        log.failed()


def _safe_seed(seed_of: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    try:
        return seed_of(*args, **kwargs)
    except Exception:
        return None  # arguments the function itself will reject: its error, not ours


def _package(frame: FrameType) -> str:
    name = frame.f_globals.get("__name__")
    return name.split(".", 1)[0] if isinstance(name, str) else ""


def first_arg(*args: Any, **kwargs: Any) -> Any:
    """The seed is the first argument (or ``seed=``): ``torch.manual_seed(seed)``, ..."""
    if args:
        return args[0]
    return kwargs.get("seed")


_LOG: SeedLog | None = None


def for_session(session: Session) -> SeedLog:
    """The run's seed log, shared by the Python, NumPy, torch and TensorFlow hooks."""
    global _LOG
    if _LOG is None or _LOG._session is not session:
        _LOG = SeedLog(session)
    return _LOG
