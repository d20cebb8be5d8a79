"""The report: what the comparison found, in one structure every presenter reads.

``Report.to_json`` is the normative JSON of docs/report.md (``nondet_report_version``
1); fields beyond the contract are extras and may be added freely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from nondet.exitcodes import ExitCode
from nondet.recipe import Suggestion

REPORT_VERSION = 1



#: Seeding calls that draw their seed themselves (and take none): recorded with it.
DRAWN_SEEDS = frozenset({"torch.seed", "torch.Generator.seed"})


def seed_verb(api: str) -> str:
    """How a seeding call came by its seed: given it ("received"), or drew it itself."""
    return "drew" if api in DRAWN_SEEDS else "received"

@dataclass
class RunSummary:
    path: str
    exit_code: int
    steps: int
    complete: bool
    status: str
    label: str = ""
    final_params_fp: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "exit_code": self.exit_code,
                               "steps": self.steps, "complete": self.complete,
                               "status": self.status, "label": self.label}
        if self.final_params_fp is not None:
            out["final_params_fp"] = f"{self.final_params_fp:016x}"
        return out


@dataclass
class ContextLine:
    index: int
    op: str
    module: str
    source: str
    state: str  # same | differs (inputs same) | differs (inputs differ)
    focus: bool = False


@dataclass
class Divergence:
    """The first divergence (``first_divergence`` in the JSON)."""

    kind: str  # op | entry | init | structure | seed
    step: int | None  # None: the init phase
    phase: str
    op: str | None = None
    node: str | None = None  # TensorFlow graph ops: the node name (op is the op type)
    op_index: int | None = None
    module: str | None = None
    source: str | None = None
    rank: int = 0
    process: str | None = None  # "child#K": found in a child process the script started
    world_size: int = 1  # > 1: a distributed job (nondet.jobs); rank says where
    mismatched_elements: int | None = None
    numel: int | None = None
    max_abs_diff: float | None = None
    # extras
    localized: bool = True  # False: only the step is known, not the op
    explained: bool = True  # False: the op's inputs differed but nothing earlier did
    entry_kind: str | None = None
    device: str | None = None  # of the op's first output
    rng_op: bool = False
    accumulates: bool = False  # called with accumulate=True (index_put_, put_)
    #: the state the op read was changed after every op of the step before matched (a
    #: thread drew from the generator): ``finding.entered_next_step``
    changed_outside: bool = False
    op_b: str | None = None  # structure: what run B executed instead
    reads_uninitialized: bool = False
    scalar_argument: bool = False
    max_abs_diff_at: list[int] | None = None
    step_fields: list[str] = field(default_factory=list)
    source_text: str = ""
    context: list[ContextLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: kind ``collective``: backend, group_size, bucket, nbytes, ddp_bucket, output_read,
    #: summary ("gloo, group of 2, bucket 0 of 25 MB"), from the capture's comm table
    collective: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "step": self.step, "phase": self.phase, "op": self.op,
            "node": self.node, "op_index": self.op_index, "module": self.module,
            "source": self.source,
            "rank": self.rank, "process": self.process,
            "world_size": self.world_size,
            "mismatched_elements": self.mismatched_elements,
            "numel": self.numel, "max_abs_diff": _finite(self.max_abs_diff),
            "localized": self.localized, "explained": self.explained,
            "entry_kind": self.entry_kind, "device": self.device, "op_b": self.op_b,
            "reads_uninitialized": self.reads_uninitialized,
            "max_abs_diff_at": self.max_abs_diff_at, "step_fields": self.step_fields,
            "source_text": self.source_text,
            "context": [vars(c) for c in self.context], "notes": self.notes,
            "collective": self.collective,
        }


@dataclass
class StateDiff:
    """How one part of the training state (parameters, gradients, optimizer state) differs
    at one step. Exact figures are None where the capture cannot tell them (never guessed):
    identical fingerprints make both 0; otherwise only the bounds the per-tensor statistics
    of a detailed step allow are known."""

    differs: bool | None = None  # None: not recorded in this step (fingerprint absent)
    max_abs_diff: float | None = None  # largest |a-b| (exact)
    frac_differ: float | None = None  # fraction of elements that differ (exact)
    max_abs_diff_min: float | None = None  # largest |a-b| is at least this
    frac_differ_max: float | None = None  # the fraction is at most this
    sum_abs_diff: float | None = None  # |sum(a) - sum(b)| over all elements
    tensors: int | None = None  # tensors compared (detailed steps)
    tensors_differ: int | None = None  # of which differ

    @property
    def magnitude(self) -> float | None:
        """The best known figure for the size of the difference: exact, else its lower
        bound (what the charts plot)."""
        return self.max_abs_diff if self.max_abs_diff is not None else self.max_abs_diff_min

    def to_json(self) -> dict[str, Any]:
        return {"differs": self.differs, "max_abs_diff": _finite(self.max_abs_diff),
                "frac_differ": _finite(self.frac_differ),
                "max_abs_diff_min": _finite(self.max_abs_diff_min),
                "frac_differ_max": _finite(self.frac_differ_max),
                "sum_abs_diff": _finite(self.sum_abs_diff), "tensors": self.tensors,
                "tensors_differ": self.tensors_differ}


#: The state parts of a growth row, in the order reports show them, with their JSON prefix.
STATE_PARTS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"))


@dataclass
class GrowthRow:
    step: int
    loss_a: float
    loss_b: float
    differing: list[str]  # state that differs at this step: data, loss, grads, params, ...
    params_sum_a: float = math.nan
    params_sum_b: float = math.nan
    params: StateDiff = field(default_factory=StateDiff)
    grads: StateDiff = field(default_factory=StateDiff)
    optimizer: StateDiff = field(default_factory=StateDiff)

    @property
    def loss_abs_diff(self) -> float | None:
        """|loss a - loss b|; None where a loss was not a finite scalar."""
        if not (math.isfinite(self.loss_a) and math.isfinite(self.loss_b)):
            return None
        return abs(self.loss_a - self.loss_b)

    def state(self, part: str) -> StateDiff:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}[part]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step, "loss_a": _finite(self.loss_a), "loss_b": _finite(self.loss_b),
            "loss_abs_diff": _finite(self.loss_abs_diff), "differing": self.differing,
            "params_sum_a": _finite(self.params_sum_a),
            "params_sum_b": _finite(self.params_sum_b)}
        for part, _ in STATE_PARTS:  # the contract's flat fields, then the detail
            diff = self.state(part)
            out[f"{part}_max_abs_diff"] = _finite(diff.max_abs_diff)
            out[f"{part}_frac_differ"] = _finite(diff.frac_differ)
        out["state"] = {part: self.state(part).to_json() for part, _ in STATE_PARTS}
        return out


@dataclass
class RepeatRow:
    """One of the N runs of ``--runs N``."""

    label: str
    steps: int
    final_loss: float
    digest: int  # fingerprint of the final parameters
    outcome: str  # "A", "B", ...: runs with the same letter ended identically
    status: str = "complete"

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "steps": self.steps, "final_loss": _finite(self.final_loss),
                "weights_digest": f"{self.digest:016x}", "outcome": self.outcome,
                "status": self.status}


@dataclass
class Source:
    """One independent source: where the runs first part with the earlier fixes applied."""

    first_divergence: Divergence
    suggestions: list[Suggestion]
    applied: tuple[str, ...] = ()  # the earlier fixes in place when it was found

    def to_json(self) -> dict[str, Any]:
        return {"first_divergence": self.first_divergence.to_json(),
                "suggestions": [s.to_json() for s in self.suggestions],
                "found_with": list(self.applied)}

    @property
    def fix(self) -> Suggestion | None:
        """The verified suggestion (ranked first by verification), if any."""
        first = self.suggestions[0] if self.suggestions else None
        return first if first is not None and first.verified else None


@dataclass
class CombinedFix:
    """Every verified fix together, and what running with all of them showed."""

    apply: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    code: list[str] = field(default_factory=list)
    verified: bool | None = None  # True the runs repeat with all; False they still part
    verified_steps: int | None = None
    cost_ratio: float | None = None
    note: str = ""  # what stopped the search and what was left unexamined

    def to_json(self) -> dict[str, Any]:
        return {"env": self.env, "code": self.code, "verified": self.verified,
                "verified_steps": self.verified_steps, "cost_ratio": self.cost_ratio,
                "apply": list(self.apply), "note": self.note}


@dataclass
class Report:
    verdict: str  # deterministic | nondeterministic | error
    exit_code: ExitCode
    runs: list[RunSummary]
    first_divergence: Divergence | None = None
    suggestions: list[Suggestion] = field(default_factory=list)
    environment_differences: list[dict[str, str]] = field(default_factory=list)
    growth: list[GrowthRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: str = ""
    op_records: int = 0  # op records compared (shown for deterministic verdicts)
    captures: list[str] = field(default_factory=list)  # every capture file written
    repeatability: list[RepeatRow] = field(default_factory=list)  # --runs N
    baseline: str | None = None  # the baseline file compared with (nondet check --baseline)
    environment_drift: list[dict[str, str]] = field(default_factory=list)  # allowed drift
    # differences that never reached the training state (the verdict ignores them)
    contained: list[dict[str, Any]] = field(default_factory=list)
    # what run a ran on (versions, hardware, the variables that change numbers)
    environment: dict[str, str] = field(default_factory=dict)
    sources: list[Source] = field(default_factory=list)  # every source, in order
    combined_fix: CombinedFix | None = None  # every verified fix together

    def to_json(self) -> dict[str, Any]:
        return {
            "nondet_report_version": REPORT_VERSION,
            "verdict": self.verdict,
            "exit_code": int(self.exit_code),
            "runs": [r.to_json() for r in self.runs],
            "first_divergence": self.first_divergence.to_json()
            if self.first_divergence else None,
            "suggestions": [s.to_json() for s in self.suggestions],
            "environment_differences": self.environment_differences,
            "growth": [g.to_json() for g in self.growth],
            "notes": self.notes,
            "command": self.command,
            "op_records_compared": self.op_records,
            "captures": self.captures,
            "repeatability": {
                "runs": [r.to_json() for r in self.repeatability],
                "distinct_outcomes": len({r.outcome for r in self.repeatability}),
            } if self.repeatability else None,
            "baseline": self.baseline,
            "environment_drift": self.environment_drift,
            "contained": self.contained,
            "environment": self.environment,
            "sources": [s.to_json() for s in self.sources],
            "combined_fix": self.combined_fix.to_json() if self.combined_fix else None,
        }


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return value
