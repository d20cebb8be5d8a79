"""Captures in, a report out: the first divergence, its context, growth and explanation.

Pure over captures already on disk (no subprocesses, no frameworks), so ``nondet diff`` and
``nondet show`` stay light; ``pipeline`` calls it for ``nondet run`` and ``check``. Where
the runs part is named in ``finding`` (the injection rule over op records, the step rows);
this module decides the verdict, adds growth and environment, and the facts recipes match.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nondet import (
    channel,
    child_captures,
    compare,
    end_state,
    environment,
    exit_place,
    readback,
    recipe,
    seed_diff,
    settings,
)
from nondet.errors import NondetError
from nondet.exitcodes import ExitCode
from nondet.finding import from_step_rows, localize, with_notes
from nondet.growth import growth
from nondet.printable import clip
from nondet.recipe import Suggestion
from nondet.records import INIT_STEP, Phase
from nondet.report import (
    Divergence,
    GrowthRow,
    RepeatRow,
    Report,
    RunSummary,
)
from nondet.store import Capture

#: How many steps the runs go on past the first difference (for the growth view).
GROWTH_STEPS = 4


# -- comparing ---------------------------------------------------------------------------------
def capture_notes(*captures: Capture) -> list[str]:
    """What the backends noted about their own capture (``capture_note.*`` facts), once."""
    notes: list[str] = []
    for capture in captures:
        for key, value in capture.facts.items():
            if key.startswith("capture_note.") and str(value) not in notes:
                notes.append(str(value))
    return notes


@dataclass(frozen=True)
class Comparison:
    """What two captures show: every part of a report that comes from the files. The
    pipeline may replace the finding (narrowed, measured) before the report is built."""

    verdict: str
    exit_code: ExitCode
    first_divergence: Divergence | None
    environment_differences: list[dict[str, str]]
    notes: list[str]
    op_records: int
    growth: list[GrowthRow] = field(default_factory=list)
    contained: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)  # run a's

    def report(self, *, runs: list[RunSummary], captures: list[str], command: str = "",
               notes: Sequence[str] = (), suggestions: Sequence[Suggestion] = (),
               repeatability: Sequence[RepeatRow] = (), baseline: str | None = None,
               environment_drift: Sequence[dict[str, str]] = ()) -> Report:
        """The one Report of this comparison, with what the caller adds (a note the finding
        already carries is said there only)."""
        said = self.first_divergence.notes if self.first_divergence is not None else []
        return Report(verdict=self.verdict, exit_code=self.exit_code, runs=runs,
                      first_divergence=self.first_divergence, suggestions=list(suggestions),
                      environment_differences=self.environment_differences,
                      growth=self.growth,
                      notes=[n for n in dict.fromkeys([*self.notes, *notes]) if n not in said],
                      command=command,
                      op_records=self.op_records, captures=captures,
                      repeatability=list(repeatability), baseline=baseline,
                      environment_drift=list(environment_drift), contained=self.contained,
                      environment=self.environment)


def compare_captures(a: Capture, b: Capture, *, command: str = "", notes: Sequence[str] = (),
                     suggest: bool = False) -> Report:
    """The report on two captures already on disk (``nondet diff``); with ``suggest``, the
    recipes that match its finding."""
    found, suggestions = compare_pair(a, b), list[Suggestion]()
    if suggest:
        found, suggestions = with_suggestions(found, a)
    return found.report(
        runs=[summary_of_capture(a), summary_of_capture(b)],
        captures=[str(a.path), str(b.path)], command=command, notes=notes,
        suggestions=suggestions)


def compare_pair(a: Capture, b: Capture) -> Comparison:
    """Compare two captures already on disk (``nondet diff``, and step 1 of ``run``)."""
    check_comparable(a, b)
    env_diff = environment.differences(a.env, b.env)
    notes = [*capture_notes(a, b), *readback.pair_notes(a, b),
             *seed_diff.unseeded_script_notes(a)]
    both_ended = _extra_steps_count(a, b)
    step_div = compare.first_step_divergence(a.steps, b.steps, count_extra_steps=both_ended)
    common_op_steps = sorted(set(a.op_steps()) & set(b.op_steps()))
    op_records = sum(min(len(a.ops(s)), len(b.ops(s))) for s in common_op_steps)
    deterministic = Comparison(verdict="deterministic", exit_code=ExitCode.DETERMINISTIC,
                               first_divergence=None, environment_differences=env_diff,
                               notes=notes, op_records=op_records, environment=dict(a.env))
    final_differs = end_state.final_params_differ(a, b)
    kids = child_captures.compare(a, b)  # the child processes' own captures
    notes += kids.notes
    deterministic = replace(deterministic, notes=notes,
                            op_records=op_records + kids.op_records)
    if not final_differs and a.n_steps == 0 and b.n_steps == 0 and (
            step_div is None or not (kids.divergence or kids.trained)):
        # No step in either run: never "deterministic" (DESIGN: exit 2), even where the
        # init rows differ (a loop nondet saw no step of, whose batches differed: it said
        # "deterministic, the difference never reached training", trial round 20)
        if kids.divergence is not None:
            return replace(deterministic, verdict="nondeterministic",
                           exit_code=ExitCode.NONDETERMINISTIC,
                           first_divergence=kids.divergence)
        if kids.trained:
            return replace(deterministic, notes=[*notes, (
                f"training ran in {kids.trained} child process(es) the script started; "
                "their steps were recorded and repeated")])
        if any(k.startswith(channel.CHILD_PARAMS_PREFIX) for k in a.facts):
            raise NondetError(
                "no training step was observed in the main process: training ran in child "
                "processes nondet could not record step by step (a Process subclass that "
                "overrides run(); their parameters after they were joined matched); pass "
                "the training function as Process(target=...), or call it in the main "
                "process, to compare it step by step")
        cut = [f"{c.path} ({c.status})" for c in (a, b)
               if c.status in ("interrupted", "crashed", "failed")]
        if cut:
            raise NondetError(
                f"no training step was recorded: {' and '.join(cut)} ended before the first "
                "step ended, so there is nothing to compare; capture runs that get past a "
                "step (nondet run, or let the runs go on longer)")
        idle = [c for c in (a, b) if c.idle_ended]
        if idle:  # a limit set far too low ends the runs before their first step
            raise NondetError(
                f"no training step was recorded: nondet ended {idle[0].path} after "
                f"{idle[0].idle_ended:.3g} s in which it sent nothing and used no CPU, "
                "before its first step ended; if the script was still loading or waiting, "
                "raise NONDET_IDLE_AFTER (seconds, default "
                f"{settings.DURATIONS['NONDET_IDLE_AFTER']:g}) or unset it")
        if a.facts.get(channel.POOL_FACT) is True:
            raise NondetError(
                "no training step was observed in the main process: the script trains in a "
                "process pool (multiprocessing.Pool, concurrent.futures.ProcessPoolExecutor), "
                "whose workers nondet does not record: a worker takes whichever task is "
                "free, so the two runs' workers cannot be paired; to compare it step by step, "
                "run the training in the main process or in Process(target=...) children")
        replaced = a.facts.get(exit_place.EXEC_AT_FACT)
        if replaced:  # os.exec* before the first step: the program it runs is not recorded
            raise NondetError(
                f"no training step was recorded: the script replaced its process ({replaced}) "
                "before its first step, and nondet does not record the program that "
                "replaces it; if that is the script run again (to set environment variables "
                "first, say), set those before `nondet run` instead")
        forks = exit_place.fork_notes(a)
        if forks:  # the child of a bare os.fork trained, unrecorded
            raise NondetError(f"no training step was observed in the main process; {forks[0]}")
        session_run = a.facts.get("tf.session_run")  # frameworks/tensorflow/graph_mode.py
        if session_run:
            raise NondetError(
                "no training step was observed: the script runs a TensorFlow 1 graph with "
                f"tf.compat.v1.Session.run (first at {session_run}), which nondet does not "
                "record; it records TensorFlow 2 code (eager, tf.function, Keras)")
        if a.facts.get(channel.JAX_FACT) is True:
            raise NondetError(
                "no training step was observed: the script uses JAX (Keras 3 on its JAX "
                "backend, or JAX itself), which nondet does not record; it records PyTorch "
                "and TensorFlow (for Keras, set KERAS_BACKEND=tensorflow or torch)")
        raise NondetError(
            "no training step was observed in either run, so nothing was compared (no "
            "optimizer step, no backward-and-update, no nondet.step()); check that the script "
            "trains with these arguments, or mark its steps with nondet.step()"
            + _before_any_step(a, b, step_div, common_op_steps))
    if step_div is None:
        # Step-level state matches; op records may still show a difference that did not
        # reach any step-level fingerprint (e.g. a discarded tensor).
        div = localize(a, b, common_op_steps) if common_op_steps else None
        if div is None:
            div = kids.divergence
        if div is None and final_differs:
            div = end_state.divergence(a, b)
        if div is None:
            # a seeding call given another seed in each run, though training repeated (a
            # generator seeded from the clock to sample after training): noted below
            div = seed_diff.seed_divergence(a, b, None)
        if div is None:
            _check_steps_compared(a, b, both_ended)
            return deterministic
    else:
        window = [s for s in common_op_steps if s <= step_div.step]
        div = localize(a, b, window) if window else None
        if div is None or (div.step if div.step is not None else INIT_STEP) > step_div.step:
            div = from_step_rows(a, b, step_div, common_op_steps)
    if (not div.explained or end_state.child_entry(a, div)) \
            and (kids.divergence or end_state.children_differ(a, b)):
        # A tensor changed outside every op this process ran (or one a joined child was
        # handed), and a child process differs (its recorded steps, or the tensors it was
        # handed): the child is the better explanation.
        div = kids.divergence or end_state.divergence(a, b)
    main_differs = final_differs or _training_state_differs(a, b, both_ended) \
        or compare.data_unsettled(a.steps, b.steps, both_ended)
    if kids.divergence is not None and not main_differs:
        div = kids.divergence  # what differs in this process never reached training
    div = seed_diff.seed_divergence(a, b, div) or div  # a differing seed is the cause
    if div.kind == "op" and a.facts.get("tf.distribute.strategy") is True:
        div = with_notes(div, STRATEGY_OP_NOTE)
    if not main_differs and kids.divergence is None:
        _check_steps_compared(a, b, both_ended)
        # The verdict follows the training state: a difference that never reached loss,
        # parameters, gradients or optimizer state (a logged metric, a clock reading, a discarded
        # tensor, an RNG nobody drew from again) is a note, not nondeterminism.
        where = f" at {div.source}" if div.source else ""
        step = "init" if div.step is None else f"step {div.step}"
        what = div.op or (", ".join(div.step_fields) if div.step_fields else "state")
        contained = (_seed_note(a, b, div, where) if div.kind == "seed" else [
            f"{step}: {what}{where} differs between the runs, but the training state (loss, "
            "parameters, gradients, optimizer state) was identical at every step: the "
            "difference never reached training"])
        return replace(deterministic, notes=[*notes, *contained], contained=[
            {"kind": "contained", "step": div.step, "phase": div.phase, "op": div.op,
             "source": div.source}])
    if step_div is not None:  # a report note: a narrowed finding replaces div's own notes
        deterministic = replace(deterministic, notes=[
            *deterministic.notes, *_earlier_data_note(a, b, step_div.step, common_op_steps)])
    return replace(deterministic, verdict="nondeterministic",
                   exit_code=ExitCode.NONDETERMINISTIC, first_divergence=div,
                   growth=[] if div.process else  # the main process's steps
                   _growth_shown(a, b, step_div.step if step_div else (div.step or 0)))


def _growth_shown(a: Capture, b: Capture, first: int) -> list[GrowthRow]:
    """The growth rows, or none where no step of them differs (a difference found only in
    the final parameters, after the last step: a table of identical steps said nothing)."""
    rows = growth(a, b, first)
    return rows if any(r.differing for r in rows) else []




def _seed_note(a: Capture, b: Capture, div: Divergence, where: str) -> list[str]:
    """Notes for a seeding call given another seed in each run while training repeated:
    what the script drew from that generator (samples after training, an evaluation) is
    outside what nondet compares, and differs between plain runs."""
    steps = min(a.n_steps, b.n_steps)
    when = ("before training" if div.step is None else "after the last training step"
            if div.step >= steps else f"at step {div.step}")
    first, *rest = div.notes or [f"{div.op} received different seeds"]
    return [f"{when}, {first.removesuffix(seed_diff.SEED_DIFFERS)}{where}: the training state "
            "(loss, parameters, gradients, optimizer state) was identical at every step, but "
            "whatever the script draws from that generator (samples, an evaluation, a metric) "
            "differs between runs", *rest]


#: An op finding in a TensorFlow step run under a tf.distribute strategy: the replicas' ops
#: are not recorded (frameworks/tensorflow/graph.py ``under_strategy``), so an op reducing
#: what they made (``strategy.reduce``'s AddN) shows no differing input even when one did.
STRATEGY_OP_NOTE = (
    "the step runs under a tf.distribute strategy, whose ops inside the replicas "
    "(strategy.run, the per-replica step) are not recorded: this op's inputs from the "
    "replicas were not compared, so the difference may have entered inside the replica step "
    "before it (a racy or stateful op there)")


def _earlier_data_note(a: Capture, b: Capture, step: int, op_steps: list[int]) -> list[str]:
    """Data that entered with different values at a step before ``step`` without changing
    the training state then (``compare.first_step_divergence`` passed it over): kept and
    used later (a replay buffer, a cache), it is where the difference came from."""
    rows_a = {int(r["step"]): r for r in a.steps}
    rows_b = {int(r["step"]): r for r in b.steps}
    earlier = next((s for s in sorted(set(rows_a) & set(rows_b)) if s < step
                    and int(rows_a[s]["data_fp"]) != int(rows_b[s]["data_fp"])), None)
    if earlier is None:
        return []
    named = from_step_rows(a, b, compare.StepDivergence(earlier, Phase.DATA, ("data_fp",)),
                           op_steps)
    what = f"{named.op} at {named.source}" if named.kind == "entry" and named.op \
        and named.source else "data"
    when = "at init" if earlier == INIT_STEP else f"at step {earlier}"  # not "step -1"
    return [f"{what} entered with different values earlier, {when}, without "
            "changing the training state then; if the script keeps it (a replay buffer, a "
            "cache) and uses it later, that is where this difference came from"]


def _check_same_framework(a: Capture, b: Capture) -> None:
    """A capture of a torch run and one of a TensorFlow run have no op, step or state in
    common: comparing them would report every difference as nondeterminism (exit 2)."""
    def frameworks(capture: Capture) -> set[str]:
        return {name for name in ("torch", "tensorflow") if f"{name}_version" in capture.env}

    made_a, made_b = frameworks(a), frameworks(b)
    if made_a and made_b and not made_a & made_b:
        raise NondetError(
            f"{a.path} was recorded with {', '.join(sorted(made_a))} and {b.path} with "
            f"{', '.join(sorted(made_b))}: nothing in them can be compared; give two captures "
            "of the same script")


def check_comparable(a: Capture, b: Capture) -> None:
    """Refuse (one line, exit 2) two captures nothing in which can be compared: of two
    frameworks, of a run and a child process, or hashed under two fingerprint schemes."""
    _check_same_framework(a, b)
    _check_same_process(a, b)
    _check_same_scheme(a, b)


_CHILD_LABEL = re.compile(r"\.child(\d+)$")


def _check_same_process(a: Capture, b: Capture) -> None:
    """A run's capture against the capture of a child process a run started (``run-b.
    child0.h5``, child_captures.py): two different programs' steps, which a comparison
    would call different (child captures also record no fingerprint scheme: it said the
    schemes differed). Child K is compared with the other run's child K."""
    kids = [_CHILD_LABEL.search(c.label) for c in (a, b)]
    if bool(kids[0]) == bool(kids[1]):
        return
    child, main = (b, a) if kids[1] else (a, b)
    number = (kids[1] or kids[0]).group(1)  # type: ignore[union-attr]
    raise NondetError(
        f"{child.path} is the capture of child process {number} that a run started, and "
        f"{main.path} a run's own: compare a run's capture with the other run's, and a "
        f"child's with the same child's of the other run (run-a.child{number}.h5 with "
        f"run-b.child{number}.h5)")


def _check_same_scheme(a: Capture, b: Capture) -> None:
    """Captures made under two fingerprint definitions (two nondet versions, across a
    change of ``fingerprint.SCHEME``) hold different fingerprints for the same tensors:
    ``nondet diff`` of them said "nondeterministic", exit 1, for runs that were bitwise
    alike. A capture without the key was made before schemes were recorded (exit 2)."""
    schemes = [str(c.env.get("fingerprint_scheme", "")) for c in (a, b)]
    if schemes[0] == schemes[1]:
        return
    made = [f"{c.path} with fingerprint scheme {clip(s) if s else '(none recorded)'}"
            f" (nondet {clip(str(c.env.get('nondet_version', '?')))})"
            for c, s in zip((a, b), schemes, strict=True)]
    raise NondetError(
        f"{made[0]} and {made[1]} compute fingerprints differently: the same tensor has "
        "another fingerprint under each, so every step would differ; capture both runs with "
        "the same nondet version (a baseline: write it again with --update-baseline)")


def _before_any_step(a: Capture, b: Capture, step_div: compare.StepDivergence | None,
                     op_steps: list[int]) -> str:
    """What already differed in runs with no step (their init rows), as the end of the
    "no training step" line: where values entered, to look at once steps are marked."""
    if step_div is None:
        return ""
    div = localize(a, b, op_steps) if op_steps else None
    if div is None:
        div = from_step_rows(a, b, step_div, op_steps)
    what = div.op or (", ".join(div.step_fields) if div.step_fields else "a value")
    where = f" at {div.source}" if div.source else ""
    return (f"; values already differ between the runs ({what}{where}), which nondet "
            "cannot place without steps")


def _check_steps_compared(a: Capture, b: Capture, both_ended: bool) -> None:
    """Before a "deterministic" verdict: a capture with no training step that is compared
    over the steps both have (it was interrupted or stopped before its first: ``diff`` of
    such a capture, a baseline) compared no step at all, which is no evidence (exit 2)."""
    empty = [c for c in (a, b) if c.n_steps == 0]
    if empty and not both_ended and len(empty) < 2:
        raise NondetError(
            f"{empty[0].path} holds no training step (the run "
            f"was {empty[0].status}), so no step was compared; give a capture of a run that "
            "got past its first step")


def _extra_steps_count(a: Capture, b: Capture) -> bool:
    """Steps only one run has are a finding when the run without them ended on its own: both
    ended (different step counts), or one ended while the other, stopped by nondet, had
    already gone past its end (lockstep stops a run once the other ends: a script that
    exits early in one run only). A run that is shorter because it was stopped or
    interrupted is compared over the steps both have; one that nondet ended because it
    had gone idle (no frame, no CPU: ``nondet.idle``) would never have gone on, so its
    steps are all it had: a run that hangs mid-training while its twin trains on is
    nondeterminism, not two runs that agree."""
    shorter, longer = (a, b) if a.n_steps <= b.n_steps else (b, a)
    ended = shorter.status == "complete" or shorter.idle_ended > 0
    return ended and (
        longer.status == "complete" or longer.idle_ended > 0
        or longer.n_steps > shorter.n_steps)


def _training_state_differs(a: Capture, b: Capture, count_extra_steps: bool) -> bool:
    """Any training-state field differs at a step both runs have, or (when both ended on
    their own) one run has a step the other lacks."""
    rows_a = {int(r["step"]): r for r in a.steps}
    rows_b = {int(r["step"]): r for r in b.steps}
    if count_extra_steps and set(rows_a) != set(rows_b):
        return True
    return any(compare.training_differs(rows_a[s], rows_b[s]) for s in set(rows_a) & set(rows_b))



# -- explaining ---------------------------------------------------------------------------------
def finding_facts(div: Divergence, capture: Capture,
                  env_differences: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """Facts about a finding for the recipe matcher (docs/recipes.md lists them)."""
    facts: dict[str, Any] = {k: v for k, v in capture.facts.items() if not k.startswith("data")}
    op = div.op or ""
    namespace = op.split(".", 1)[0] if "." in op else ""
    framework = capture.facts.get("framework") or _framework_of_old_capture(div, capture)
    is_torch = framework == "torch"
    facts.update(
        framework=framework,
        op=op, phase=div.phase, kind=div.kind, entry_kind=div.entry_kind,
        reads_uninitialized=div.reads_uninitialized,
        explained=div.explained,  # False: its inputs differed, yet no earlier op's output
        custom_op=bool(is_torch and div.kind == "op" and namespace
                       and namespace not in ("aten", "prims", "c10d", "_c10d_functional")),
    )
    facts["device"] = div.device
    # the entry's own line reads the clock: its value is another number in every run
    facts["entry.reads_clock"] = bool(
        div.kind == "entry" and div.source and _READS_CLOCK.search(capture.source_text(div.source)))
    facts["rng_op"] = div.rng_op
    facts["op.accumulates"] = div.accumulates  # accumulate=True (index_put_, put_)
    facts["state.changed_outside_ops"] = div.changed_outside
    facts["localized"] = div.localized  # False: only the step is known, not the op
    # the script seeds torch itself: "seed it" is no fix for a random op that drew otherwise
    facts["torch.seeded_by_script"] = any(
        api in seed_diff.TORCH_SEEDS for api, _, _ in seed_diff.seed_calls(capture))
    # Keras ran several steps per traced call: their op records are the first step's
    facts["tf.steps_per_execution"] = bool(capture.facts.get("capture_note.steps_per_execution"))
    facts["child_process"] = bool(div.process)  # found in a process the script started
    facts["seed.in_loader_worker"] = seed_diff.in_loader_worker(capture, div)
    for key, value in capture.env.items():
        if key.endswith("_version"):
            facts[key] = value
    if div.entry_kind == "dataloader" and div.op:
        index = div.op.rsplit("#", 1)[-1]
        facts.update(capture.facts.get(f"dataloader#{index}", {}))
    for kind in ("numpy.unseeded_generator", "python.unseeded_random", "python.system_random",
                 "python.set_iteration", "python.unsorted_listing", "python.completion_order",
                 "python.threads", "python.clock_reads", "python.thread_count_computed",
                 "torch.jit_fork",
                 "tf.image.stateful_random",
                 "tf.data.list_files_shuffled", "tf.distribute.strategy",
                 "tf.distribute.parameter_server"):
        facts[kind] = bool(capture.facts.get(kind))
    # only the library generators that may have fed something (seed_diff.library_generators)
    facts["library.unseeded_generator"] = bool(seed_diff.library_generators(capture.facts)[0])
    for d in env_differences or ():
        facts[f"env_differs.{d['key'].removeprefix('env.')}"] = True
    # the user's own PYTHONHASHSEED=random (kept, as asked): str hashes salted in every run
    facts["python.hash_salted"] = capture.env.get("env.PYTHONHASHSEED") == "random"
    for key in ("backend", "group_size", "ddp_bucket"):  # a collective finding (collective.py)
        if div.collective and div.collective.get(key) is not None:
            facts[f"comm.{key}"] = div.collective[key]
    return facts


#: Calls that read the wall or monotonic clock, as a line of source shows them.
_READS_CLOCK = re.compile(r"\b(time\.(time|time_ns|perf_counter|perf_counter_ns|monotonic|"
                          r"monotonic_ns|process_time)|datetime\.(now|utcnow|today))\s*\(")


def with_suggestions(found: Comparison, capture: Capture) -> tuple[Comparison, list[Suggestion]]:
    """The finding with the library generators that may feed it named, and the recipes that
    match it (unseeded generators' lines are recipe sites)."""
    div = found.first_divergence
    if div is None:
        return found, []
    div = with_notes(div, *seed_diff.library_generator_notes(div, capture))
    sites = seed_diff.library_generator_facts(capture.facts)
    set_line = capture.facts.get(f"{channel.OPTIMIZER_PARAMS_SET}.line")
    if set_line:  # the line that gave an optimizer a set of parameters (owners.py)
        sites = {**sites, f"{channel.OPTIMIZER_PARAMS_SET}.line": [set_line]}
    return replace(found, first_divergence=div), recipe.suggest(
        finding_facts(div, capture, found.environment_differences), sites=sites)


def summary_of_capture(c: Capture) -> RunSummary:
    return RunSummary(path=str(c.path), exit_code=c.exit_code, steps=c.n_steps,
                      complete=c.complete, status=c.status, label=c.label)


def _framework_of_old_capture(div: Divergence, capture: Capture) -> str:
    """Captures written before the run's framework was recorded (the ``framework`` fact,
    sent when training starts): judged from the versions and the op's name."""
    namespace = (div.op or "").split(".", 1)[0] if "." in (div.op or "") else ""
    is_torch = "torch_version" in capture.env and (namespace != "" or div.kind == "entry"
                                                  or "tensorflow_version" not in capture.env)
    return "torch" if is_torch else "tensorflow"
