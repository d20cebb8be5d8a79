"""Seeding calls compared between two captures: the ``seed`` finding.

The child records every seeding call (``nondet.seeding``: API, call site, values in order).
Two runs of one script make the same calls with the same values; a value that differs came
from the clock, the pid, ``os.urandom`` or a ``uuid``. That call is the finding, at its own
line, ahead of the first op that consumed the difference, provided it happened no later than
that op's step (a seed derived from an earlier difference is a consequence, not the cause)
and that op is not a cause of its own (it differs from equal inputs and draws no random
numbers: a race; the seed is then a note).

Pure over captures (no frameworks), like ``analysis``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nondet import channel, early_draws, unordered
from nondet.clock import CLOCK_FACT
from nondet.generator_use import USE_FACT
from nondet.pyhooks import KERAS_DEFAULT_SEED, LIBRARY_UNSEEDED
from nondet.records import INIT_STEP
from nondet.report import Divergence
from nondet.report import seed_verb as got
from nondet.seeding import SEED_FACT_PREFIX
from nondet.store import Capture

#: Named in the finding when run b's clock ran ahead (``nondet.clock``).
CLOCK_NOTE = ("nondet runs run b with its clock {offset:g} s ahead on purpose, so that a seed "
              "read from the clock differs even when both runs start in the same second")


#: Ends the first note of a seed finding (after the API and the two values).
SEED_DIFFERS = ": the seed itself differs between the runs"


@dataclass(frozen=True)
class SeedDifference:
    api: str
    site: str
    library: str
    step: int
    value_a: str
    value_b: str
    seq: int  # position of run a's call among all its seeding calls


def seed_calls(capture: Capture) -> dict[tuple[str, str, str], list[tuple[int, int, str]]]:
    """(api, site, library) -> [(seq, step, value), ...] in call order. Malformed entries
    (a capture is untrusted input) are left out, never guessed at."""
    out: dict[tuple[str, str, str], list[tuple[int, int, str]]] = {}
    for key, value in capture.facts.items():
        if not key.startswith(SEED_FACT_PREFIX) or not isinstance(value, dict):
            continue
        api, site, library = (value.get(k) for k in ("api", "site", "library"))
        calls = value.get("calls")
        if not (isinstance(api, str) and isinstance(site, str) and isinstance(library, str)
                and isinstance(calls, list)):
            continue
        rows = [(c[0], c[1], c[2]) for c in calls if _is_call(c)]
        out.setdefault((api, site, library), []).extend(rows)
    return out


def _is_call(call: Any) -> bool:
    return (isinstance(call, list) and len(call) == 3 and type(call[0]) is int
            and type(call[1]) is int and isinstance(call[2], str))


def first_seed_difference(a: Capture, b: Capture) -> SeedDifference | None:
    """The earliest seeding call (in run a's order) whose value differs in run b; calls are
    matched per API and call site, in order."""
    calls_a, calls_b = seed_calls(a), seed_calls(b)
    found: SeedDifference | None = None
    for key in calls_a.keys() & calls_b.keys():
        if _reordered(calls_a[key], calls_b[key]):
            continue
        for (seq, step, va), (_, _, vb) in zip(calls_a[key], calls_b[key], strict=False):
            if va != vb:
                if found is None or seq < found.seq:
                    found = SeedDifference(*key, step=step, value_a=va, value_b=vb, seq=seq)
                break
    return found


def _reordered(calls_a: list[tuple[int, int, str]], calls_b: list[tuple[int, int, str]]
               ) -> bool:
    """The calls at one site received the same seeds in both runs, in another order: threads
    seeding one generator each with a constant (a shard's id) finish in another order from
    run to run. No seed differs; what the order changes shows up where it is used."""
    return (len(calls_a) == len(calls_b)
            and sorted(c[2] for c in calls_a) == sorted(c[2] for c in calls_b))


def seed_divergence(a: Capture, b: Capture, div: Divergence | None) -> Divergence | None:
    """The seed finding, if a seeding call differs no later than ``div`` (the finding so far,
    None if none); else None."""
    diff = first_seed_difference(a, b)
    if diff is None:
        return None
    if div is not None and diff.step > (INIT_STEP if div.step is None else div.step):
        return None  # the seed came after the difference: it may be derived from it
    values = f"{_shown(diff.value_a)} in run a and {_shown(diff.value_b)} in run b"
    if div is not None and _independent(div):
        div.notes.append(f"{diff.api} at {diff.site or diff.library} also {got(diff.api)} "
                         f"different seeds ({values}), but this op differs with all its "
                         "inputs equal and draws no random numbers: a cause of its own")
        return None
    notes = [f"{diff.api} {got(diff.api)} {values}{SEED_DIFFERS}"]
    origin = clock_origin(a, diff), clock_origin(b, diff)
    if origin[0] is not None and origin[0] == origin[1]:
        site, unit = origin[0]
        text = a.source_text(site)
        notes.append(f"the seed was read from the clock at {site}"
                     + (f" ({text})" if text else "")
                     + f": both runs' seeds equal that line's reading of the wall clock "
                     f"(in {unit}); take the seed from "
                     + ("torch.initial_seed() there (each worker's own, repeating)"
                        if _in_loader_worker(a, diff) else "a constant or the command line there"))
    if diff.library:
        notes.append(f"the call is made by {diff.library}, called from {diff.site or '?'}")
    if _in_worker(a, diff):
        notes.append("the call ran in a worker process the run forked (a DataLoader "
                     "worker's worker_init_fn, say): each worker seeds itself there, so "
                     "every batch it makes differs")
    offset = b.facts.get(CLOCK_FACT)
    if isinstance(offset, int | float) and offset > 0:
        notes.append(CLOCK_NOTE.format(offset=offset))
    found = Divergence(
        kind="seed", step=None if diff.step == INIT_STEP else diff.step,
        phase="init" if diff.step == INIT_STEP else "other", op=diff.api, module="",
        source=diff.site or None, notes=notes)
    found.source_text = a.source_text(diff.site) if diff.site else ""
    return found


def _site_facts(capture: Capture, diff: SeedDifference) -> list[dict[str, Any]]:
    """The capture's facts of ``diff``'s call site."""
    return [value for key, value in capture.facts.items()
            if key.startswith(SEED_FACT_PREFIX) and isinstance(value, dict)
            and (value.get("api"), value.get("site"), value.get("library"))
            == (diff.api, diff.site, diff.library)]


def _in_worker(capture: Capture, diff: SeedDifference) -> bool:
    """``diff``'s calls were made in forked worker processes (``worker_seeds``)."""
    return any(value.get("worker") is True for value in _site_facts(capture, diff))


def _in_loader_worker(capture: Capture, diff: SeedDifference) -> bool:
    return any(value.get("loader_worker") is True for value in _site_facts(capture, diff))


def in_loader_worker(capture: Capture, div: Divergence) -> bool:
    """A seed finding whose call ran in torch DataLoader workers (``worker_seeds``): the
    fix is the worker's own seed, not a constant every worker would share."""
    return div.kind == "seed" and any(
        value.get("loader_worker") is True for key, value in capture.facts.items()
        if key.startswith(SEED_FACT_PREFIX) and isinstance(value, dict)
        and value.get("api") == div.op and (value.get("site") or None) == div.source)


def clock_origin(capture: Capture, diff: SeedDifference) -> tuple[str, str] | None:
    """(line, unit) of the clock reading the run's seed at ``diff``'s call site equalled
    (``seeding`` notes it in the child), if it did."""
    for value in _site_facts(capture, diff):
        origin = value.get("clock")
        if isinstance(origin, dict) and isinstance(origin.get("site"), str) \
                and isinstance(origin.get("how"), str) and origin["site"]:
            return origin["site"], origin["how"]
    return None


def _independent(div: Divergence) -> bool:
    """An op that made a difference from equal inputs without drawing random numbers (a
    race, a nondeterministic kernel) is not explained by a seed."""
    return (div.kind == "op" and div.localized and div.explained and not div.rng_op
            and not div.scalar_argument)


def _shown(value: str) -> str:
    return value if len(value) <= 40 else value[:39] + "…"


def library_generators(facts: dict[str, Any]) -> tuple[list[str], int]:
    """The unseeded generators libraries made (``pyhooks``) that may matter, those drawn
    from in the run first; and how many were left out: made and let go without a single
    draw (``generator_use``), they cannot have fed anything; and, in a run with no worker
    processes to draw from them unseen, those whose state never moved (module-level ones a
    library makes at import: sympy's, more_itertools')."""
    sites = facts.get(LIBRARY_UNSEEDED)
    if not isinstance(sites, list):
        return [], 0
    use = facts.get(USE_FACT)
    use = use if isinstance(use, dict) else {}
    unseen_draws = _workers_may_draw(facts)
    kept: list[str] = []
    for text in (str(s) for s in sites):
        record = use.get(text)
        if isinstance(record, dict) and (_let_go_undrawn(record) or (
                not unseen_draws and not _ever_drawn(record))):
            continue
        kept.append(text)
    drawn = [t for t in kept if isinstance(use.get(t), dict) and _ever_drawn(use[t])]
    return [*drawn, *(t for t in kept if t not in drawn)], len(sites) - len(kept)


def _workers_may_draw(facts: dict[str, Any]) -> bool:
    """Whether processes the script started could draw from a library generator where this
    run's follower does not see it (DataLoader workers, pools, children): "never moved
    here" then proves nothing."""
    for key, value in facts.items():
        if key.startswith("dataloader#") and isinstance(value, dict) \
                and (value.get("loader.num_workers") or 0) > 0:
            return True
    return any(key.startswith((channel.CHILD_PARAMS_PREFIX, channel.POOL_FACT))
               for key in facts)


def _let_go_undrawn(record: dict[str, Any]) -> bool:
    freed = record.get("freed")
    made = record.get("made")
    return (isinstance(freed, list) and isinstance(made, int) and 0 < made <= len(freed)
            and not _ever_drawn(record))


def _ever_drawn(record: dict[str, Any]) -> bool:
    freed = record.get("freed")
    return bool(record.get("drawn")) or (isinstance(freed, list) and any(
        isinstance(f, list) and len(f) == 2 and bool(f[1]) for f in freed))


def library_generator_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """The capture's facts with only the library generators that may matter, in rank order
    (recipe sites list them as "unseeded generator at ...")."""
    if LIBRARY_UNSEEDED not in facts:
        return facts
    return {**facts, LIBRARY_UNSEEDED: library_generators(facts)[0]}


def library_generator_notes(div: Divergence, capture: Capture) -> list[str]:
    """For a value that entered with different values: the unseeded generators libraries
    made (``pyhooks``), named with the library frame and the user's line that led there."""
    if div.kind not in ("entry", "init"):
        return []
    sites, left_out = library_generators(capture.facts)
    if not sites:
        return []
    shown = "; ".join(sites[:3]) + ("; ..." if len(sites) > 3 else "")
    notes = [f"an unseeded random generator was made inside a library ({shown}): it draws "
             "from fresh OS entropy, so its values differ in every run"]
    if left_out:
        notes.append(f"{left_out} more unseeded generator(s) made inside libraries were let "
                     "go without a single draw (replaced by seeded ones): not the cause")
    return notes


#: The calls that seed TensorFlow's global random state (Keras' seeds Python, NumPy and
#: TensorFlow at once); a ``Generator.from_seed`` or a NumPy ``default_rng(0)`` is not one.
TF_GLOBAL_SEEDS = frozenset({"tf.random.set_seed", "keras.utils.set_random_seed"})

UNSEEDED_TF_NOTE = (
    "the script seeds neither TensorFlow nor Keras (no keras.utils.set_random_seed or "
    "tf.random.set_seed call): nondet seeded Python, NumPy and TensorFlow alike in both "
    "runs (--seed), so these two runs share initial weights, dropout masks and shuffles, "
    "but the script run on its own draws new ones each time: call "
    "keras.utils.set_random_seed(0) at its start")


#: The calls that seed Python's ``random``, where Keras 3 draws its default seeds from.
PYTHON_SEEDS = frozenset({"random.seed", "keras.utils.set_random_seed"})

#: UNSEEDED_TF_NOTE for a script that seeds Python's random: Keras 3's layers repeat on
#: their own then, and only TensorFlow's unseeded ops would not (TensorFlow round 11).
PYTHON_SEEDED_TF_NOTE = (
    "the script seeds Python's random, from which Keras 3 takes the default seeds of its "
    "layers, but not TensorFlow (no tf.random.set_seed or keras.utils.set_random_seed "
    "call): TensorFlow's own random ops and tf.data shuffles made without seed= draw new "
    "values in every plain run, while nondet seeded both runs alike (--seed); if the "
    "script uses any, call keras.utils.set_random_seed(0) at its start")

KERAS_PYTHON_SEED_NOTE = (
    "the script seeds TensorFlow (tf.random.set_seed) but not Python's random, from which "
    "Keras 3 draws the seed of every layer, initializer and random op made without seed=: "
    "nondet seeded Python in both runs (--seed), so these two runs share initial weights "
    "and dropout masks, but the script run on its own draws new ones each time: call "
    "keras.utils.set_random_seed(0) (Python, NumPy and TensorFlow at once) in place of "
    "tf.random.set_seed")


#: Run a's fact (``frameworks/torch/draws.py``): the first draw from torch's default
#: generator made before the script seeded it.
TORCH_UNSEEDED_DRAW = "torch.unseeded_draw"

#: torch's seeding calls, made by the script or by a library that seeds for it.
TORCH_SEEDS = frozenset({"torch.manual_seed", "keras.utils.set_random_seed"})


def unseeded_script_notes(capture: Capture) -> list[str]:
    """A TensorFlow script that never seeds the global random state repeats under nondet
    (which seeds it) and not on its own: the verdict alone would hide that. So does one
    that seeds TensorFlow alone while Keras 3 draws its default seeds from Python, a
    torch script that draws before it seeds, and one that iterates a set of strings
    (``unordered``: nondet fixed PYTHONHASHSEED for both runs)."""
    # the script's set iterations (the string hash salt: unordered.py), whatever the framework
    hashed = [n for n in [unordered.note(capture.facts), unordered.hash_note(capture.facts),
                          unordered.address_note(capture.facts),
                          unordered.timer_note(capture.facts),
                          unordered.thread_count_note(capture.facts)] if n]
    return _seeding_notes(capture) + hashed


def _seeding_notes(capture: Capture) -> list[str]:
    calls = seed_calls(capture)
    # the script's draws from Python's and NumPy's global generators, whatever the framework
    python = early_draws.notes_for(capture.facts, calls,
                                   [early_draws.PYTHON_GLOBAL, early_draws.NUMPY_GLOBAL])
    if capture.facts.get("framework") == "torch":
        return _torch_draw_notes(capture) + python
    if capture.facts.get("framework") != "tensorflow":
        return python
    apis = {api for api, _, _ in calls}
    if not apis & TF_GLOBAL_SEEDS:
        return [PYTHON_SEEDED_TF_NOTE if apis & PYTHON_SEEDS else UNSEEDED_TF_NOTE, *python]
    if capture.facts.get(KERAS_DEFAULT_SEED) is True and not apis & PYTHON_SEEDS:
        return [KERAS_PYTHON_SEED_NOTE, *python]
    return early_draws.notes_for(capture.facts, calls)


# Note [A draw before the first seeding is a note]
# The two runs nondet compares were seeded alike before the script started, and they
# repeated: "nondeterministic" (exit 1) would claim a difference between them that did not
# happen, and DESIGN.md gives the verdict to the training state of the compared runs only.
# What the user needs is still said: their plain runs draw those numbers from fresh entropy
# (torch 2.x seeds its default generator so in every process), so weights, masks and
# shuffles drawn before the first seeding differ from one plain run to the next. It is a
# note with the line of the first such draw and the fix (PT-RNG), as the TensorFlow
# counterpart above is; `nondet check` stays green, as for an unseeded TensorFlow script.


def _torch_draw_notes(capture: Capture) -> list[str]:
    draw = capture.facts.get(TORCH_UNSEEDED_DRAW)
    if not isinstance(draw, dict) or not isinstance(draw.get("site"), str):
        return []
    site, op = draw["site"], draw.get("op")
    seeds = sorted((calls[0][0], site_) for (api, site_, _), calls in seed_calls(capture).items()
                   if api in TORCH_SEEDS and calls)
    later = (f"before the script's first seeding call ({seeds[0][1]})" if seeds
             else "and the script never seeds torch")
    what = f" ({op})" if isinstance(op, str) and op else ""
    outer = draw.get("from")
    if isinstance(outer, str) and outer:
        what += f", called from {outer},"
    return [f"{site} draws from torch's default random generator{what} {later}: nondet "
            "seeded both runs alike (--seed), so they repeated, but run on its own the "
            "script draws these numbers (initial weights, masks, shuffles) from fresh "
            "entropy each time, so they differ from one plain run to the next [PT-RNG]: call "
            "torch.manual_seed(0) (or transformers.set_seed / lightning.seed_everything) "
            "before the first model, layer or random tensor is made"]
