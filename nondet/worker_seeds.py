"""Seeding calls made in the run's forked worker processes (DataLoader workers, Pool workers).

A ``worker_init_fn`` that seeds ``random``/``np.random`` from the clock or the pid gives each
run different batches; the seeding call runs in a forked worker, which cannot write to the
run's pipe (its frames would interleave with the parent's). So a worker appends one short
JSON line per seeding call to a file of its own run's, ``run-a.worker-seeds`` beside the
capture (one ``os.write`` of under ``PIPE_BUF`` bytes with ``O_APPEND``: lines of two
workers never mix), and the run's main process turns the lines into ``seed#`` facts when
it ends (``collect``), so ``seed_diff`` names the worker's seeding line, and the line that
read the clock when the seed equals that reading (``clock.origin_of`` works in the worker:
it inherited the shifted clock and its watch).

Workers start in an order the scheduler decides, so a site's calls are compared as a
multiset: sorted by (step, value), never in arrival order (``worker_init_fn`` seeding
``base + worker_id`` must not differ because worker 1 wrote first).

Recorded child processes (``frameworks/torch/children.py``) have a session of their own and
are not workers; spawned processes run no nondet hooks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from nondet import clock

#: Bound at import, before the script runs (see ``channel._dumps``).
_dumps = json.dumps

if TYPE_CHECKING:
    from nondet.frameworks.base import Session


class SeedLog(Protocol):
    """What this module asks of ``seeding.SeedLog`` (which imports this module)."""

    def is_users(self, frame: FrameType) -> bool: ...

    def library_frame(self, frame: FrameType, package: str) -> str: ...

    def step(self) -> int: ...

#: Longest line a worker writes: one atomic ``O_APPEND`` write.
_MAX_LINE = 3000
#: Calls kept per run (a dataset seeding per sample in every worker).
MAX_LINES = 4096
_OS_OPEN = os.open  # the real one (readback.py wraps os.open for the script's reads)


def path_for(session: Session) -> str | None:
    """The file the run's workers append to (None: this run has no directory for it)."""
    config = session.config
    folder = getattr(config, "children_dir", None)
    label = getattr(config, "label", None)
    if not folder or not isinstance(label, str):
        return None
    return seeds_file(folder, label)


def seeds_file(folder: str, label: str) -> str:
    """The file the workers of run ``label`` append to, in ``folder``."""
    return os.path.join(folder, f"run-{label}.worker-seeds")


def note(log: SeedLog, path: str, api: str, value: Any, frame: FrameType,
         seed_text: str, package: str) -> None:
    """One seeding call in a forked worker: a line in ``path``. Never raises (a worker has
    no way to report nondet's trouble; the call is then simply not named)."""
    try:
        user: FrameType | None = frame
        while user is not None and not log.is_users(user):
            user = user.f_back
        if user is None:
            return  # no line of the user's led here: nothing to name
        own = log.is_users(frame)
        origin = clock.origin_of(value)
        record = {"api": api, "file": user.f_code.co_filename, "line": user.f_lineno,
                  "library": "" if own else log.library_frame(frame, package),
                  "package": "" if own else package,
                  "step": int(log.step()), "value": seed_text,
                  "clock": list(origin) if origin is not None else None,
                  "loader": loader_worker_seed() is not None}
        data = (_dumps(record) + "\n").encode("utf-8", "surrogatepass")
        if len(data) > _MAX_LINE:
            return
        fd = _OS_OPEN(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except Exception:
        pass


def loader_worker_seed() -> int | None:
    """In a torch DataLoader worker, the seed torch gave it: ``base_seed + worker_id``, with
    ``base_seed`` drawn from the run's seeded torch RNG (or the loader's ``generator=``), so
    it differs between workers and repeats between runs (what ``torch.initial_seed()``
    returns there). None elsewhere, a Pool worker included. Never raises."""
    data = sys.modules.get("torch.utils.data")  # never imported here: a torch run has it
    get_worker_info = getattr(data, "get_worker_info", None)
    try:
        info = get_worker_info() if get_worker_info is not None else None
        return None if info is None else int(info.seed)
    except Exception:
        return None


#: Lines that name where a worker made an unseeded generator (``api``: the pyhooks fact)
#: rather than a seeding call; ``collect`` returns their sites under that fact.
UNSEEDED_KINDS = ("numpy.unseeded_generator", "python.unseeded_random", "python.system_random")


def collect(session: Session, first_seq: int, prefix: str) -> dict[str, Any]:
    """The workers' seeding calls of this run as facts named ``prefix`` + "workerN" (sent
    by the caller), their unseeded generators' sites as lists under their ``UNSEEDED_KINDS``
    fact, and the file removed. Lines that do not parse are left out."""
    path = path_for(session)
    if path is None or not os.path.isfile(path):
        return {}
    try:
        lines = Path(path).read_bytes().splitlines()[:MAX_LINES]
    finally:
        Path(path).unlink(missing_ok=True)
    sites: dict[tuple[str, str, str, str], list[tuple[int, str, Any, bool]]] = {}
    unseeded: dict[str, list[str]] = {}
    for raw in lines:
        record = _parse(raw)
        if record is None:
            continue
        sid = session.sources.intern_location(record["file"], record["line"])
        if record["api"] in UNSEEDED_KINDS:
            made = unseeded.setdefault(record["api"], [])
            if session.string(sid) not in made:
                made.append(session.string(sid))
            continue
        key = (record["api"], session.string(sid), record["library"], record["package"])
        sites.setdefault(key, []).append((record["step"], record["value"], record["clock"],
                                          record.get("loader") is True))
    facts: dict[str, Any] = dict(unseeded)
    seq = first_seq
    for n, ((api, site, library, package), calls) in enumerate(sorted(sites.items())):
        calls.sort(key=lambda c: (c[0], c[1]))
        rows = []
        for step, value, _, _ in calls:
            seq += 1
            rows.append([seq, step, value])
        data: dict[str, Any] = {"api": api, "site": site, "library": library,
                                "package": package, "calls": rows, "worker": True,
                                "loader_worker": all(c[3] for c in calls)}
        origins = {tuple(c[2]) for c in calls if c[2] is not None}
        if len(origins) == 1 and all(c[2] is not None for c in calls):
            filename, line, how = next(iter(origins))
            csid = session.sources.intern_location(filename, line)
            data["clock"] = {"site": session.string(csid), "how": how}
        facts[f"{prefix}worker{n}"] = data
    return facts


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    ok = (isinstance(record.get("api"), str) and isinstance(record.get("file"), str)
          and type(record.get("line")) is int and isinstance(record.get("library"), str)
          and isinstance(record.get("package"), str) and type(record.get("step")) is int
          and isinstance(record.get("value"), str))
    origin = record.get("clock")
    if origin is not None and not (
            isinstance(origin, list) and len(origin) == 3 and isinstance(origin[0], str)
            and type(origin[1]) is int and isinstance(origin[2], str)):
        return None
    return record if ok else None
