"""Naming the finding: where two captures part, as one ``Divergence``.

``localize`` applies the injection rule (``compare.first_op_divergence``: record arrays in,
first finding out) over the op records of some steps and names what it found (op, module,
line, context); ``from_step_rows`` names a difference no op record covers from the step
rows; ``measure_from_dumps`` adds the sizes of a difference from the outputs both runs
saved. Pure over captures (no subprocesses, no frameworks): ``analysis`` and the pipeline
use it alike.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from nondet import compare, exit_place, loop_end
from nondet.records import (
    ENTRY_KINDS,
    INIT_STEP,
    OP_DTYPE,
    STEP_COMPONENTS,
    Flag,
    Group,
    Kind,
    Phase,
    device_of,
    split_node,
)
from nondet.report import ContextLine, Divergence
from nondet.store import Capture

_FIELD_LABELS = {name: name.removesuffix("_fp") for name, _ in STEP_COMPONENTS}


def measure_from_dumps(div: Divergence, da: Capture, db: Capture) -> Divergence | None:
    """The finding with the sizes of its difference, from the outputs of its record saved in
    two captures; None if they hold none."""
    step = INIT_STEP if div.step is None else div.step

    def outputs(c: Capture) -> dict[str, np.ndarray]:
        return {name.rsplit("-", 1)[-1]: array for name, (array, attrs) in c.dumps.items()
                if attrs.get("step") == step and attrs.get("index") == div.op_index}

    xa, xb = outputs(da), outputs(db)
    names = sorted(set(xa) & set(xb))
    if not names:
        return None
    stats: dict[str, Any] = {}
    for name in names:
        candidate = compare.mismatch_stats(xa[name], xb[name])
        stats = stats or candidate
        if candidate.get("mismatched_elements"):
            stats = candidate
            break
    return replace(div, numel=stats.get("numel"),
                   mismatched_elements=stats.get("mismatched_elements"),
                   max_abs_diff=stats.get("max_abs_diff"),
                   max_abs_diff_at=stats.get("max_abs_diff_at"))


def with_notes(div: Divergence, *notes: str) -> Divergence:
    """The finding with more notes (a new value: findings are not patched in place)."""
    return replace(div, notes=[*div.notes, *notes])



def from_step_rows(a: Capture, b: Capture, step_div: compare.StepDivergence,
                   op_steps: list[int]) -> Divergence:
    """The finding at the first step whose rows differ when no op record of it names one
    (``op_steps``: the steps both runs recorded op by op): the data that entered, the state
    changed after the step's last op (read at the next step), or the step-level difference."""
    return (_data_entry_divergence(a, b, step_div)
            or entered_next_step(a, b, step_div.step, op_steps)
            or _step_level_divergence(step_div, a, b))


def _data_entry_divergence(a: Capture, b: Capture,
                           step_div: compare.StepDivergence) -> Divergence | None:
    """When the first thing that differs in a step is the data that entered, the step rows
    name each entry (batch, NumPy-made tensor): the first differing one is the finding,
    even without op-level recording of that step."""
    if not step_div.fields or step_div.fields[0] != "data_fp":
        return None
    rows_a = [r for r in a.tensor_rows(step_div.step) if int(r["group"]) == Group.DATA]
    rows_b = [r for r in b.tensor_rows(step_div.step) if int(r["group"]) == Group.DATA]
    first = first_differing_entry([(a.string(int(r["name"])), int(r["fp"])) for r in rows_a],
                                  [(b.string(int(r["name"])), int(r["fp"])) for r in rows_b])
    if first is not None:
        ra = rows_a[first]
        label_a = a.string(int(ra["name"]))
        name, _, source = label_a.partition(" @ ")
        if label_a != b.string(int(rows_b[first]["name"])):
            source = ""  # the runs saw different entries here: placed by neither
        entry_kind, _, what = name.partition(":")
        step = step_div.step
        div = Divergence(
            kind="entry", step=None if step == INIT_STEP else step,
            phase="init" if step == INIT_STEP
            else "data" if entry_kind in ("dataloader", "tf_data") else "forward",
            op=what, module="", source=source or None,
            entry_kind=entry_kind if entry_kind in ENTRY_KINDS else "external",
            numel=int(ra["numel"]) if int(ra["numel"]) >= 0 else None,
            source_text=source_text(a, source or None),
            notes=["named from the step-level record of the data that entered; the op-level "
                   "records do not cover this step"])
        return div
    return None


def first_differing_entry(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> int | None:
    """The position of the first data entry (label, fingerprint) of a step that differs
    between two runs' rows, or None; entries are compared in the order they entered."""
    for i, (entry_a, entry_b) in enumerate(zip(a, b, strict=False)):
        if entry_a != entry_b:
            return i
    return None


def placed_entry(label: str) -> bool:
    """A data entry's label names the line it entered at ("kind:what @ file:line"): a
    finding named by it needs no narrowing (pipeline._explain)."""
    return bool(label.partition(" @ ")[2])


def entered_next_step(a: Capture, b: Capture, step: int,
                       op_steps: list[int]) -> Divergence | None:
    """Every op recorded at ``step`` matched, yet its end state differs: the state changed
    after the step's last op, outside every op (another process writing shared memory, a
    thread). The next recorded step reads it: its entry there is the evidence."""
    if step not in op_steps or step + 1 not in op_steps:
        return None  # an op of an unrecorded step may have made it: narrowing finds it
    div = localize(a, b, [step + 1])
    if div is None:
        return None
    return replace(with_notes(
        div, f"the state at the end of step {'init' if step == INIT_STEP else step} already "
        "differed, after every op that step ran matched: it was changed outside the ops "
        "nondet sees, and is read here"), changed_outside=True)


def _step_level_divergence(step_div: compare.StepDivergence, a: Capture,
                           b: Capture) -> Divergence:
    fields = [_FIELD_LABELS.get(f, f) for f in step_div.fields]
    if step_div.structural:
        shorter, longer = (a, b) if a.n_steps < b.n_steps else (b, a)
        went_on = (f"after {longer.n_steps}" if longer.status == "complete" else
                   f"went on to {longer.n_steps} (then nondet stopped it)")
        exited = exit_place.ended_at(shorter)
        ended = (exited[0], f"at {exited[1]}() in {exited[0]}") if exited \
            else loop_end.ended_at(shorter)
        at = f" {ended[1]}" if ended else ""
        return Divergence(kind="structure", step=step_div.step, phase="other", localized=False,
                          source=ended[0] if ended else None,
                          source_text=source_text(shorter, ended[0] if ended else None),
                          notes=[f"run {shorter.label} ended after {shorter.n_steps} steps{at}, "
                                 f"run {longer.label} {went_on}: the number of "
                                 "steps depends on a value that differs between the runs"])
    kind = "init" if step_div.step == INIT_STEP else "op"
    return Divergence(
        kind=kind, step=None if step_div.step == INIT_STEP else step_div.step,
        phase=step_div.phase.label, localized=False, step_fields=fields,
        notes=[f"step-level state differs ({', '.join(fields)}) but no op-level recording "
               "covers this step in both files"],
    )


def localize(a: Capture, b: Capture, steps: list[int]) -> Divergence | None:
    """Apply the injection rule over the op records of ``steps`` (in execution order)."""
    ops_a = concat([a.ops(s) for s in steps])
    ops_b = concat([b.ops(s) for s in steps])
    found = compare.first_op_divergence(ops_a, ops_b, a.strings, b.strings)
    if found is None:
        return None
    row = found.row_a if found.row_a is not None else found.row_b
    assert row is not None
    capture = a if found.row_a is not None else b
    step = int(row["step"])
    name = capture.string(int(row["name"]))
    entry_kind = None
    op, node = split_node(name)
    if int(row["kind"]) != Kind.OP:
        op, node = name, None
        entry_kind, _, op = name.partition(":")
        entry_kind = entry_kind if entry_kind in ENTRY_KINDS else "external"
    if found.scalar_argument:
        entry_kind = "python_value"
    op_a = op_b = None
    notes = []
    if found.kind == "structure":
        op_a = split_node(a.string(int(found.row_a["name"])))[0] \
            if found.row_a is not None else None
        op_b = split_node(b.string(int(found.row_b["name"])))[0] \
            if found.row_b is not None else None
        notes.append("the runs executed different ops here: control flow (or the number "
                     "of batches) depends on a value that differs between runs")
    if not found.explained:
        notes.append("this op's inputs already differed but no earlier recorded op or entry "
                     "did: a tensor was changed outside the ops nondet sees (another "
                     "thread, a NumPy view, a C extension)")
    if found.scalar_argument:
        notes.append("the op's tensor inputs matched but a Python number passed to it "
                     "differed: that value came from outside the framework")
    source = capture.string(int(row["source"])) or None
    context = [
        ContextLine(index=int(ops_a[j]["index"]), op=split_node(a.string(int(ops_a[j]["name"])))[0],
                    module=a.string(int(ops_a[j]["module"])),
                    source=a.string(int(ops_a[j]["source"])), state=state,
                    focus=j == found.position)
        for j, state in found.context
        if j < len(ops_a) and int(ops_a[j]["step"]) == step  # the finding's step only
    ]
    flags = int(row["flags"])
    return Divergence(
        kind=found.kind, step=None if step == INIT_STEP else step,
        phase=Phase(int(row["phase"])).label if step != INIT_STEP else "init",
        op=op_a if found.kind == "structure" else op, node=node, op_index=int(row["index"]),
        module=capture.string(int(row["module"])), source=source, entry_kind=entry_kind,
        explained=found.explained, reads_uninitialized=found.reads_uninitialized,
        scalar_argument=found.scalar_argument, op_b=op_b, notes=notes,
        source_text=source_text(capture, source), context=context,
        # of the first output; the dump pass may refine it
        numel=int(row["numel"]) if int(row["numel"]) >= 0 else None,
        device=device_of(flags) if int(row["kind"]) == Kind.OP else None,
        rng_op=bool(flags & Flag.RNG),
        accumulates=bool(flags & Flag.ACCUMULATES),
    )


def concat(parts: list[np.ndarray]) -> np.ndarray:
    parts = [p for p in parts if len(p)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=OP_DTYPE)


def source_text(capture: Capture, source: str | None) -> str:
    # The text the run captured with the location: never a file a capture names.
    return capture.source_text(source) if source else ""
