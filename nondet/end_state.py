"""The end state the runs left: final parameters and saved buffers, and the tensors handed
to each child process when it was joined (facts ``final_params_fp``, ``final_buffers_fp``
and ``child#K.params_fp``).

Training nondet does not record step by step (in child processes, in other threads, after
the last step) shows up only here; a difference here is never "deterministic".
"""

from __future__ import annotations

from nondet import channel
from nondet.records import INIT_STEP
from nondet.report import Divergence
from nondet.store import Capture


def final_params_differ(a: Capture, b: Capture) -> bool:
    """The final parameters or saved buffers differ (sent as facts when the script ends),
    or the tensors handed to a child process differ when the parent joined it
    (``child#K.params_fp``): training nondet did not record shows up here."""
    return bool(differences(a, b))


def _child_index(key: str) -> int:
    """K of ``child#K.params_fp`` (-1 if malformed: a capture is untrusted input)."""
    text = key.removeprefix(channel.CHILD_PARAMS_PREFIX).partition(".")[0]
    return int(text) if text.isdigit() else -1


def differences(a: Capture, b: Capture) -> list[str]:
    """Keys of the end-state facts both runs sent with different values: the children in
    creation order, then the final parameters."""
    children = sorted((k for k in a.facts if k.startswith(channel.CHILD_PARAMS_PREFIX)
                       and k.endswith(".params_fp") and _child_index(k) >= 0),
                      key=_child_index)
    finals = [k for k in ("final_params_fp", "final_buffers_fp") if k in a.facts]
    keys = [*children, *finals]
    return [k for k in keys
            if b.facts.get(k) is not None and a.facts[k] is not None and a.facts[k] != b.facts[k]]


def child_entry(a: Capture, div: Divergence) -> bool:
    """``div`` is an entry of a tensor a joined child process was handed (its name is
    ``child:<K>``): what the child left, not something this process did."""
    if div.kind != "entry" or div.op_index is None:
        return False
    step = INIT_STEP if div.step is None else div.step
    names = [a.string(int(r["name"])) for r in a.ops(step) if int(r["index"]) == div.op_index]
    return bool(names) and names[0].startswith(channel.CHILD_ENTRY_PREFIX)


def children_differ(a: Capture, b: Capture) -> bool:
    return any(k.startswith(channel.CHILD_PARAMS_PREFIX) for k in differences(a, b))


def divergence(a: Capture, b: Capture) -> Divergence:
    last = a.n_steps - 1
    differing = differences(a, b)
    children = [_child_index(k) for k in differing if k.startswith(channel.CHILD_PARAMS_PREFIX)]
    if children:
        note = (f"the parameters handed to child process #{children[0]} (creation order) "
                "differ between the runs when it was joined, although every step recorded "
                "in the main process was identical: what a child does is not recorded op "
                "by op (processes updating shared parameters without a lock race, as in "
                "Hogwild; a child may also seed from its pid or the clock)")
        fields = [f"child #{children[0]} params"]
    elif "final_params_fp" in differing:
        note = ("the final parameters differ although every recorded step was identical: "
                "they were changed where nondet does not record (child processes, other "
                "threads, code after the last step)")
        fields = ["final params"]
    else:
        note = ("the final buffers a state_dict saves differ although every recorded step "
                "and the final parameters were identical: they were changed after the last "
                "step (BatchNorm statistics recomputed by torch.optim.swa_utils.update_bn or "
                "a calibration pass, on batches that differ between the runs) or where "
                "nondet does not record (child processes, other threads)")
        fields = ["final buffers"]
    return Divergence(kind="op", step=last if last >= 0 else None, phase="other",
                      localized=False, step_fields=fields, notes=[note])
