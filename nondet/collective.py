"""The ``collective`` finding of a torchrun job: a collective whose output differs between
the runs while every rank's inputs to it matched made the difference itself (arrival order
of a receive from any source, reduction order or algorithm). ``nondet.jobs`` asks
``as_collective`` about each rank's first difference.

The difference shows in one of two records (frameworks/torch/comm.py): the collective's
own record, whose output fingerprint is taken once the script waited for it (an ``op``
difference with matching inputs at a ``c10d.*`` record), or, when the script did not wait
within the step, the value's first reader (an entry named ``comm:<op>``). Either way the
inputs of the comm records of that step, up to this collective, must match on every rank;
otherwise a rank fed it the difference and the finding stays where that rank made it.

The finding carries what the capture's ``comm`` table recorded of the call (``collective``
in the JSON report): backend, group size, DDP bucket, so that recipes are chosen by the
backend and op recorded (``comm.backend`` ... facts, analysis.finding_facts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from nondet.finding import source_text
from nondet.frameworks.torch.comm import ENTRY_PREFIX
from nondet.records import CommOutput, Kind, Phase
from nondet.report import Divergence
from nondet.store import Capture

#: Op names of collectives as the dispatcher sees them (c10d's ops).
COLLECTIVE_PREFIXES = ("c10d.", "_c10d_functional.", "c10d_functional.")

_OUTPUT_READ = {CommOutput.NOT_READ: "not read in its step",
                CommOutput.AFTER_WAIT: "read after Work.wait()",
                CommOutput.AFTER_BACKWARD: "read after the backward pass (DDP bucket)",
                CommOutput.ON_DEVICE: "read on the device after the collective's stream work"}


def is_collective(op: str | None) -> bool:
    return bool(op) and str(op).startswith(COLLECTIVE_PREFIXES)


def as_collective(div: Divergence | None, rank: int,
                  caps: dict[int, tuple[Capture, Capture]]) -> Divergence | None:
    """This rank's first difference as a ``collective`` finding, or None when it is not a
    collective's output or some rank's inputs to the step's collectives differed."""
    if div is None or div.step is None or div.op_index is None:
        return None
    a, _ = caps[rank]
    comm = _comm_rows(a, div.step)
    if div.kind == "op" and div.explained and is_collective(div.op):
        at = [i for i, r in enumerate(comm) if int(r["index"]) == div.op_index]
        if not at:
            return None
        ordinal, read_at = at[0], None
    elif div.kind == "entry":
        names = [a.string(int(r["name"])) for r in a.ops(div.step)
                 if int(r["index"]) == div.op_index]
        if not names or not names[0].startswith(ENTRY_PREFIX):
            return None  # not a value a collective wrote
        op = names[0].removeprefix(ENTRY_PREFIX)
        before = [i for i, r in enumerate(comm) if int(r["index"]) < div.op_index
                  and a.string(int(r["name"])) == op]
        if not before:
            return None
        ordinal, read_at = before[-1], div.op_index
    else:
        return None
    for ca, cb in caps.values():
        ra, rb = _comm_rows(ca, div.step), _comm_rows(cb, div.step)
        upto = min(ordinal + 1, len(ra), len(rb))
        if any(int(x["in_fp"]) != int(y["in_fp"]) for x, y in zip(ra[:upto], rb[:upto],
                                                                   strict=True)):
            return None
    row = comm[ordinal]
    info = call_info(a, div.step, int(row["index"]))
    source = a.string(int(row["source"])) or None
    where = (f"the difference was first read at record #{read_at}" if read_at is not None
             else "its output was fingerprinted after the work completed")
    detail = f" ({info['summary']})" if info else ""
    return replace(div, kind="collective", phase="comm", op=a.string(int(row["name"])),
                   op_index=int(row["index"]), module=a.string(int(row["module"])),
                   source=source, source_text=source_text(a, source), entry_kind=None,
                   explained=True, collective=info,
                   notes=[*div.notes, f"its output differs while every rank's inputs to the "
                          f"collectives up to it matched{detail}; {where}"])


def call_info(capture: Capture, step: int, index: int) -> dict[str, Any] | None:
    """What the capture's ``comm`` table holds of the collective at that record."""
    row = capture.comm_row(step, index)
    if row is None:
        return None
    backend = capture.string(int(row["backend"])) if int(row["backend"]) >= 0 else ""
    size, bucket, nbytes = int(row["group_size"]), int(row["bucket"]), int(row["nbytes"])
    output = int(row["output"])
    parts = [backend or "backend unknown",
             f"group of {size}" if size >= 0 else "group size unknown"]
    if bucket >= 0:
        parts.append(f"bucket {bucket} of {_size(nbytes)}")
    return {"backend": backend or None, "group_size": size if size >= 0 else None,
            "bucket": bucket if bucket >= 0 else None, "nbytes": nbytes if nbytes >= 0 else None,
            "ddp_bucket": bucket >= 0,
            "output_read": _OUTPUT_READ.get(CommOutput(output), "") if output <= max(
                CommOutput) else "", "summary": ", ".join(parts)}


def _size(nbytes: int) -> str:
    if nbytes < 0:
        return "unknown size"
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def _comm_rows(capture: Capture, step: int) -> list[np.void]:
    return [r for r in capture.ops(step) if int(r["phase"]) == Phase.COMM
            and int(r["kind"]) == Kind.OP]
