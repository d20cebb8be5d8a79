"""Every source: with the verified fixes in place, run on; if the runs still part, localize
the next difference the way the first was, verify a fix for it, and go on.

A job can have more than one independent source of nondeterminism (data order and an
atomic-add kernel, say). Fixing the first one only moves the first difference. So once a
fix is verified for the first finding, the pair is run again with every fix so far applied,
for the whole script (or ``--verify-steps`` / ``--max-steps`` steps), stopping a few steps
after they part (the pair that verified the last fix, where it ran on that far itself:
``verify``'s ``run_on``). If they repeat, the fixes together are the combined fix, verified
over those steps, with their step-time cost against the first pair's (the same invocation).
If they part, that is the next source: narrowed, measured and explained with the earlier
fixes applied, and its suggestions verified with the earlier fixes kept applied.

It stops when the runs repeat, when a source has no fix verified (nondet cannot go past
it from outside), or when a budget is spent: ``max_fixes`` fixes, or ``seconds`` of wall
time (checked before each pair of runs: a pair already started is finished). What was left
unexamined is said in ``CombinedFix.note``.

Each source after the first writes its captures in a folder of its own (``source-2``, ...)
inside the invocation's directory, so no capture of an earlier source is overwritten.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nondet import compare, interventions, verify
from nondet.recipe import Suggestion
from nondet.report import CombinedFix, Divergence, Source
from nondet.store import Capture, open_capture

__all__ = ["Budget", "CombinedFix", "Source", "every_source"]  # Source: data in nondet.report

#: Fixes kept applied together at most, unless --max-fixes says otherwise.
DEFAULT_MAX_FIXES = 3
#: Wall-time budget of the search (seconds), unless --verify-budget says otherwise.
DEFAULT_BUDGET_SECONDS = 900.0


@dataclass
class Budget:
    max_fixes: int = DEFAULT_MAX_FIXES
    steps: int | None = None  # steps the runs with every fix compare (None: to the end)
    seconds: float = DEFAULT_BUDGET_SECONDS
    pairs: int = 1  # pairs a fix must hold in to be verified (--verify-pairs)


class Steps(Protocol):
    """What the search needs from the pipeline, each with the given fixes applied and its
    captures written in the given folder."""

    def run_on(self, apply: tuple[str, ...], folder: Path,
               stop_after: int | None) -> tuple[Path, Path]:
        """Both runs from the start, stopping a few steps after they part."""
        ...

    def explain(self, apply: tuple[str, ...], folder: Path, a: Capture, b: Capture,
                ) -> tuple[Divergence | None, list[Suggestion], list[str]]:
        """The finding of a pair that parted, narrowed and measured, with its suggestions."""
        ...

    def verify(self, apply: tuple[str, ...], folder: Path, suggestions: list[Suggestion],
               pair: tuple[Capture, Capture], finding_step: int,
               ) -> tuple[list[Suggestion], list[str]]:
        """``verify.verify`` with ``apply`` kept applied under every candidate."""
        ...


def every_source(first: Source, pair: tuple[Capture, Capture], steps: Steps, out_dir: Path,
                 budget: Budget, stage: Callable[[str], None], *, whole_script: bool = False,
                 ) -> tuple[list[Source], CombinedFix | None, list[str]]:
    """The sources in order (the first one given, already verified), the combined fix, and
    every capture written. No combined fix when the first source has no verified fix.

    ``whole_script``: the first pair ran the script to its end, so a fix verified over
    every step they compared already shows the runs repeat over the whole script (no
    further pair is run for it)."""
    started = time.monotonic()
    base_time = verify.step_time(pair[0].steps, pair[1].steps)
    first_last = max((int(x) for c in pair for x in c.steps["step"]), default=0)
    sources = [first]
    written: list[str] = []
    used: set[Path] = set()  # folders this search wrote to (never written twice)
    fix = first.fix
    if (whole_script and budget.steps is None and fix is not None and fix.parts_again is None
            and fix.verified_steps == _training_steps(*pair)):
        combined = _combined(sources, (fix.verified_with,))
        combined.verified, combined.verified_steps = True, fix.verified_steps
        combined.cost_ratio = fix.cost_ratio
        return sources, combined, written
    while True:
        applied = tuple(s.fix.verified_with for s in sources if s.fix is not None)
        last = sources[-1]
        if last.fix is None:
            if len(sources) == 1:
                return sources, None, written
            return sources, _combined(sources, applied, note=(
                f"source {len(sources)} has no fix nondet could verify from outside; "
                "what follows it was not examined")), written
        folder = _fresh(out_dir / f"source-{len(sources) + 1}", used)
        folder.mkdir(exist_ok=True)
        spent = time.monotonic() - started
        if spent >= budget.seconds:
            return sources, _combined(sources, applied, note=_out_of_time(budget, len(sources),
                                                                          "run on")), written
        if last.fix.parts_again is not None:
            # the verifying pair already ran on with every fix and parted: localize from it
            a, b = (open_capture(p) for p in last.fix.verified_captures)
        elif last.fix.ran_on:
            # the verifying pair ran on with every fix and repeated: the answer, no new pair
            a, b = (open_capture(p) for p in last.fix.verified_captures)
            combined = _combined(sources, applied)
            combined.verified, combined.verified_steps = True, _training_steps(a, b)
            combined.cost_ratio = verify.ratio(_step_time_upto(a, b, first_last), base_time)
            return sources, combined, written
        else:
            stage(f"running on with {interventions.describe(applied)}: do the runs now "
                  "repeat?")
            a, b = (open_capture(p) for p in steps.run_on(
                applied, folder, None if budget.steps is None else budget.steps - 1))
            written += [str(a.path), str(b.path)]
        parted = compare.parted_in_training(a.steps, b.steps)
        compared = _training_steps(a, b)
        if parted is None:
            combined = _combined(sources, applied)
            combined.verified, combined.verified_steps = compared > 0, compared
            combined.cost_ratio = verify.ratio(_step_time_upto(a, b, first_last), base_time)
            return sources, combined, written
        where = f"at step {parted.step}" if parted.step >= 0 else "at init"
        if len(applied) >= budget.max_fixes:
            return sources, _combined(sources, applied, steps=compared, note=(
                f"the runs still part {where} with all {len(applied)} fixes; not examined: "
                f"at most {budget.max_fixes} fixes are combined (--max-fixes)")), written
        if time.monotonic() - started >= budget.seconds:
            return sources, _combined(sources, applied, steps=compared,
                                      note=_out_of_time(budget, len(sources), where)), written
        stage(f"source {len(sources) + 1}: the runs still part {where}; localizing it with "
              "the earlier fixes applied")
        div, suggestions, extra = steps.explain(applied, folder, a, b)
        written += extra
        if div is None:
            return sources, _combined(sources, applied, steps=compared, note=(
                f"the runs still part {where}, but the difference could not be localized"
                )), written
        again = _same_as_before(sources, div)
        if again is not None:
            # the op an earlier fix was verified for parts the runs again: that fix only
            # happened to hold past its step, so it is not verified after all
            fix = again.fix
            assert fix is not None
            fix.verified, fix.parts_again = False, None
            fix.verify_note = (f"did not hold: with it the same op parted the runs again "
                               f"{where}")
            if again is sources[0] and _verify_the_rest(again, pair, steps, folder, written):
                del sources[1:]  # found with a fix that did not hold: looked for again
                continue
            kept = tuple(s.fix.verified_with for s in sources if s.fix is not None)
            return sources, _combined(sources, kept, steps=compared, note=(
                f"the fix for source {sources.index(again) + 1} did not hold: the same op "
                f"parted the runs again {where}")), written
        if suggestions and time.monotonic() - started < budget.seconds:
            suggestions, extra = steps.verify(applied, folder, suggestions, (a, b),
                                              -1 if div.step is None else div.step)
            written += extra
        sources.append(Source(div, suggestions, applied))


def _verify_the_rest(source: Source, pair: tuple[Capture, Capture], steps: Steps,
                     folder: Path, written: list[str]) -> bool:
    """The first source's fix did not hold (a race parted the pair that verified it only
    later, by chance): verify its suggestions not tried yet, on the first pair; True if one
    holds, now ranked first (the DataLoader fixture's in_order fix went untried behind an
    unseeded ``random.SystemRandom`` that merely happened to hold)."""
    untried = [s for s in source.suggestions if s.verified is None and s.recipe.apply]
    if not untried:
        return False
    div = source.first_divergence
    checked, extra = steps.verify(source.applied, folder, untried, pair,
                                  -1 if div.step is None else div.step)
    written.extend(extra)
    if not checked or not checked[0].verified:
        return False
    winner = checked[0]
    source.suggestions[:] = [winner, *[s for s in source.suggestions if s is not winner]]
    return True


def _fresh(folder: Path, used: set[Path]) -> Path:
    """``folder``, or ``folder-2``, ``-3``, ... if this search wrote there already: after
    the first source's fix failed and another was verified, the search looks for source 2
    again, and its runs' captures would go where the last attempt's are still open (the
    DataLoader fixture's "cannot write source-2/run-a-all.h5: unable to truncate a file
    which is already open", exit 2, in CI)."""
    name, k = folder, 1
    while name in used:
        k += 1
        name = folder.with_name(f"{folder.name}-{k}")
    used.add(name)
    return name


def _same_as_before(sources: list[Source], div: Divergence) -> Source | None:
    for source in sources:
        d = source.first_divergence
        if (d.kind, d.op, d.source, d.module) == (div.kind, div.op, div.source, div.module):
            return source
    return None


def _out_of_time(budget: Budget, found: int, where: str) -> str:
    unexamined = ("whether the runs repeat with all the fixes" if where == "run on"
                  else f"the difference {where} that remains with all the fixes")
    return (f"the time budget of {budget.seconds:g} s ran out after {found} source"
            f"{'s' if found != 1 else ''} (--verify-budget); not examined: {unexamined}")


def _combined(sources: list[Source], applied: tuple[str, ...], steps: int | None = None,
              note: str = "") -> CombinedFix:
    """The environment and code lines of every verified fix. An environment intervention is
    a line of the environment; a switch or a patch stands in for the user's own code change,
    which is the suggestion's fix (at the line the source was found, for a patch)."""
    combined = CombinedFix(apply=applied, note=note)
    if note:
        combined.verified, combined.verified_steps = False, steps
    for source in sources:
        fix = source.fix
        if fix is None or fix.verified_with not in interventions.TABLE:
            continue
        intervention = interventions.TABLE[fix.verified_with]
        if intervention.how == "env":
            combined.env.update(intervention.env)
            continue
        line = fix.fix
        # the user's change goes where the capture says (the line that made the unseeded
        # generator), else at the line the source was found
        where = ", ".join(fix.sites[:3]) or source.first_divergence.source
        if intervention.how == "patch" and where:
            line = (line.replace("  # ", f"  # at {where}: ", 1) if "  # " in line
                    else f"{line}  # at {where}")
        if line not in combined.code:
            combined.code.append(line)
    return combined


def _step_time_upto(a: Capture, b: Capture, last: int) -> float | None:
    """Step time over the steps the first pair ran (like with like: the first steps of a
    job, tracing and warm-up included, cost more than the later ones)."""
    return verify.step_time(a.steps[a.steps["step"] <= last], b.steps[b.steps["step"] <= last])


def _training_steps(a: Capture, b: Capture) -> int:
    return len({s for s in a.steps["step"].tolist() if s >= 0} & set(b.steps["step"].tolist()))
