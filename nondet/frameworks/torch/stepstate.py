"""Step-level state of the torch backend as fingerprints: parameters, buffers, gradients,
optimizer state and RNG states, at each step end; per tensor, with float statistics, in
steps with op-level capture (the report can then name the tensor and size a difference),
else one fingerprint per group."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from nondet.fingerprint import scalar_value
from nondet.frameworks.base import StepState, TensorRow
from nondet.frameworks.fp import Fp, group_fp
from nondet.frameworks.torch import hoststats
from nondet.frameworks.torch.cache import FingerprintCache
from nondet.frameworks.torch.hashing import TorchHasher
from nondet.frameworks.torch.hostwords import StateViews
from nondet.frameworks.torch.tensors import item
from nondet.records import Group

#: One fingerprint per named tensor (detailed steps) or per group: (name, fp, tensor).
Named = list[tuple[str, Fp, torch.Tensor | None]]


@dataclass
class GroupFps:
    """One group's fingerprints at a step end. ``group``: what the step row's value is made
    of, the same in every step, with op capture or without: one fingerprint of the group's
    tensors concatenated (per device), then its numbers. ``rows``: the tensor rows of a
    step with op capture (one per named tensor, so the report can name them), else
    ``group`` itself. Captures of one script made under other schedules (``nondet run``'s
    and ``--ops all``'s, a baseline's) compare step by step: their step rows must not
    depend on which steps had op capture."""

    rows: Named
    group: list[Fp]


class StateFingerprints:
    """Fingerprints of the named state, through the recorder (its cache in captured steps,
    its pending values resolved with the step's own in one read-back). Call it while the
    backend's capture is paused: the work here is nondet's, never recorded."""

    def __init__(self, recorder: FingerprintCache, hasher: TorchHasher) -> None:
        self.recorder = recorder
        self.hasher = hasher
        # Word views of each group's tensors, kept from step to step; gradients too (a view
        # owns no memory, so it keeps nothing alive; gradients kept across steps reuse it)
        self.views = {group: StateViews() for group in (Group.PARAM, Group.BUFFER,
                                                         Group.GRAD, Group.OPTIM)}

    def named(self, named: list[tuple[str, Any]], detailed: bool,
              group: Group = Group.GRAD) -> GroupFps:
        """Fingerprints of named tensors (and numbers) of ``group``: one for the whole
        group, hashed as a single concatenation (a few large ops instead of several small
        ones per tensor), and in steps with op capture one per tensor too."""
        numbers: Named = [(n, Fp(value=scalar_value(v)), None) for n, v in named
                          if not isinstance(v, torch.Tensor)]
        tensors = [(n, v) for n, v in named if isinstance(v, torch.Tensor)]
        whole: Named = [("(group)", fp, None) for fp in self.recorder.fingerprint_many(
            [t for _, t in tensors], self.views[group])] + numbers
        rows = [(n, self.of(t), t) for n, t in tensors] + numbers if detailed else whole
        return GroupFps(rows, [fp for _, fp, _ in whole])

    def of(self, t: torch.Tensor) -> Fp:
        """The fingerprint of one tensor: from the cache if current, else hashed now."""
        return self.recorder.known(t) or self.recorder.remember(t, self.recorder.fingerprint(t))

    def step_state(self, params: list[tuple[str, Any]], buffers: list[tuple[str, Any]],
                   optim: list[tuple[str, Any]], grads: GroupFps,
                   loss_scalar: torch.Tensor | None, detailed: bool
                   ) -> tuple[StepState, float | None]:
        """The step's state row, and the loss read back with it (None: no loss scalar)."""
        groups: list[tuple[Group, GroupFps]] = [
            (Group.PARAM, self.named(params, detailed, Group.PARAM)),
            (Group.BUFFER, self.named(buffers, detailed, Group.BUFFER)),
            (Group.GRAD, grads),
            (Group.OPTIM, self.named(optim, detailed, Group.OPTIM)),
        ]
        # a fresh copy of each generator's state: hashed, never cached (nothing reads it)
        rng = [self.recorder.fingerprint(torch.get_rng_state())]
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            rng.extend(self.recorder.fingerprint(s) for s in torch.cuda.get_rng_state_all())
        keys = [(group, name, t) for group, fps in (groups if detailed else [])
                for name, _, t in fps.rows if t is not None]
        computed = self.hasher.stats_many([t for _, _, t in keys])
        stats = dict(zip([(group, name) for group, name, _ in keys], computed, strict=True))
        # a detailed step has each parameter's sum already: the same float, not summed twice
        known = {id(t): pair[0] for (group, _, t), pair in zip(keys, computed, strict=True)
                 if group is Group.PARAM and pair and isinstance(pair[0], float)}
        params_sum = _params_sum(params, known)
        # Every pending Fp of this step (data and losses too) and the float64 scalars still
        # on a device come back in one transfer per device (readback.py), never one per
        # tensor; statistics computed on the host (hoststats.py) are floats already.
        params_sum = _on_host(params_sum)
        loss_read = _on_host(loss_scalar) if loss_scalar is not None else None
        scalars = [x for x in (params_sum, loss_read) if isinstance(x, torch.Tensor)]
        scalars += [x for pair in stats.values() if pair for x in pair
                    if isinstance(x, torch.Tensor)]
        values = iter(self.recorder.resolve(scalars))

        def value(x: torch.Tensor | float) -> float:
            return next(values) if isinstance(x, torch.Tensor) else x

        params_value = value(params_sum)
        loss = value(loss_read) if loss_read is not None else None
        host_stats = {key: (value(pair[0]), value(pair[1])) for key, pair in stats.items()
                      if pair}
        state = StepState(
            params=group_fp([fp.value or 0 for fp in groups[0][1].group]),
            buffers=group_fp([fp.value or 0 for fp in groups[1][1].group]),
            grads=group_fp([fp.value or 0 for fp in groups[2][1].group]),
            optim=group_fp([fp.value or 0 for fp in groups[3][1].group]),
            params_sum=params_value,
            rng=[fp.value or 0 for fp in rng],
        )
        for group, fps in groups if detailed else []:
            for name, fp, t in fps.rows:
                total, maxabs = host_stats.get((group, name), (math.nan, math.nan))
                state.tensors.append(TensorRow(group, name, fp.value or 0, total, maxabs,
                                               t.numel() if t is not None else 0))
        return state, loss


def _on_host(x: torch.Tensor | float) -> torch.Tensor | float:
    """A plain CPU scalar's value read now (the same float: no device to wait for, and
    cheaper than the read-back's bit-pattern round trip: ~50 us per step for the loss),
    anything else as it is."""
    if type(x) is torch.Tensor and x.is_cpu:
        return float(item(x))
    return x


def _params_sum(params: list[tuple[str, Any]], known: dict[int, float]
                ) -> torch.Tensor | float:
    """The float64 sum of all floating parameters' values (NaN: none): on the host when
    every one is a plain CPU tensor NumPy reads (hoststats.py: no torch reduction, so no
    OpenMP barrier at every step end), else a device scalar read back with the rest.
    ``known``: host sums of parameters by id (their statistics in a detailed step)."""
    floating = [p for _, p in params if p.is_floating_point()]
    reals = [hoststats.host_reals(p) for p in floating]
    if all(r is not None for r in reals):
        total = 0.0  # added in parameter order: the same float in both runs
        for p, r in zip(floating, reals, strict=True):
            part = known.get(id(p))
            total += hoststats.real_sum(r) if part is None else part  # type: ignore[arg-type]
        return total if floating else math.nan
    sums = [p.detach().sum(dtype=torch.float64) for p in floating]
    return torch.stack(sums).sum()
