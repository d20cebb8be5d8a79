"""Step-level state of a TensorFlow run hashed where the variables live.

At each step end every tracked variable is fingerprinted by one computation that returns
all the step row needs as one int64 vector: one
content sum per group (parameters, buffers, optimizer state), one per random-generator
state, the parameters' float64 sum and, in detailed steps, each variable's content, sum,
largest magnitude and size. The vector is read back once per step; no variable is copied
to the host. A group's content is ``sum_i content_i * chunk_keys[i]`` mod 2**64 (the same
weighting as chunks in Note [Fingerprint definition]), its fingerprint that content
combined with every member's dtype and shape.

Tracing that computation costs a fraction of a second per variable set, and the set changes
in the first steps (optimizer slots appear at the first update), so the first call with a
set runs eagerly and the second traces it: one trace per run, not one per set. Whether a
variable is initialized is asked once per variable, on the host (a ``tf.cond`` per variable
doubled the trace time); one not yet initialized counts as zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import ResourceVariable, UninitializedVariable

from nondet.fingerprint import chunk_keys, combine, name_code
from nondet.frameworks.base import StepState, TensorRow
from nondet.frameworks.tensorflow.graph import to_host
from nondet.frameworks.tensorflow.hashing import HASHABLE, GraphHasher
from nondet.frameworks.tensorflow.state import TrackedVariable
from nondet.frameworks.tensorflow.statefold import FoldedGroup, foldable
from nondet.records import Group

_GROUPS = (Group.PARAM, Group.BUFFER, Group.OPTIM)
#: Per variable in detailed steps: content, float64 sum, float64 largest magnitude, size.
_PER_VARIABLE = 4
#: Traced state functions kept (one per variable set and detail level; a run has two or three).
_KEPT_FUNCTIONS = 8


@dataclass
class _Metas:
    """Each group's dtypes and shapes of one variable set, as its fingerprint mixes them in
    (worked out once per set: ``_meta`` per variable per step was about a tenth of the
    hash's time on the narrow model)."""

    groups: dict[Group, tuple[int, ...]]
    rngs: list[tuple[int, ...]]  # each random generator's


class StateHasher:
    """Fingerprints of the tracked variables, computed in-graph (module docstring)."""

    def __init__(self, hasher: GraphHasher) -> None:
        self.hasher = hasher
        # per variable set (and detail level) seen: its traced function, once called twice
        self._functions: dict[tuple[Any, ...], Callable[..., tf.Tensor] | None] = {}
        self._metas: dict[tuple[Any, ...], _Metas] = {}  # the same keys
        # the last set asked about, to skip rebuilding its key: (tracked variables, their
        # shape objects, initialized, detailed) and its key
        self._last: tuple[list[Any], list[Any], list[bool], bool, tuple[Any, ...]] | None = None
        #: after a detailed call: each initialized variable's content (Note [First reads])
        self.contents: list[tuple[TrackedVariable, int]] = []

    def state(self, tracked: list[tuple[TrackedVariable, Any]], detailed: bool) -> StepState:
        """The step-level state of the live tracked variables (those of a dtype that can be
        hashed; a variable not yet initialized counts as zeros)."""
        live = [(t, v) for t, v in tracked if getattr(v, "dtype", None) in HASHABLE]
        for t, v in live:
            if not t.initialized:  # asked until true: a variable never becomes uninitialized
                t.initialized = bool(v.is_initialized())
        ready = [t.initialized for t, _ in live]
        variables = [v for _, v in live]
        key = self._key(live, ready, detailed)
        if key not in self._functions:  # a new set: eager this once (module docstring)
            if len(self._functions) >= _KEPT_FUNCTIONS:  # the sets keep changing
                self._functions.clear()
                self._metas.clear()
            groups = [t.group for t, _ in live]
            self._functions[key] = None
            metas = self._metas[key] = _Metas(
                {g: tuple(m for t, v in live if t.group == g for m in _meta(v))
                 for g in _GROUPS},
                [_meta(v) for t, v in live if t.group == Group.DATA])
            values = to_host(self._computation(variables, groups, ready, detailed)(
                *variables))
        else:
            metas = self._metas[key]
            function = self._functions[key]
            if function is None:
                # Kept as the concrete function and called directly: a tf.function call
                # first matches every argument against its traced signatures, which with a
                # few dozen variables cost ~40% of the whole hash (CPU time per step on
                # bench/model_tf.py: 4.4 -> 2.8 ms narrow, 6.9 -> 5.0 ms reference).
                groups = [t.group for t, _ in live]
                function = tf.function(
                    self._computation(variables, groups, ready, detailed),
                    autograph=False).get_concrete_function(*variables)
                self._functions[key] = function
            values = to_host(_call(function, variables))
        state = _unpack(values, live, metas, detailed)
        if detailed:
            at = len(_GROUPS) + len(metas.rngs) + 1
            self.contents = [(t, int(values[at + i * _PER_VARIABLE]))
                             for i, (t, _) in enumerate(live) if t.initialized]
        return state

    def _key(self, live: list[tuple[TrackedVariable, Any]], ready: list[bool],
             detailed: bool) -> tuple[Any, ...]:
        """The set's key: each variable's group, dtype, shape and whether it is initialized.
        The same tracked variables with the same shape objects as last time have the same
        key (a variable's dtype never changes; a new shape is a new object): formatting
        every shape each step cost as much as a tenth of the hash on the narrow model."""
        tracked = [t for t, _ in live]
        shapes = [v.shape for _, v in live]
        last = self._last
        if (last is not None and last[3] == detailed and last[2] == ready
                and len(last[0]) == len(tracked)
                and all(a is b for a, b in zip(last[0], tracked, strict=True))
                and all(a is b for a, b in zip(last[1], shapes, strict=True))):
            return last[4]
        key = (tuple((int(t.group), v.dtype.name, str(v.shape), t.initialized)
                     for t, v in live), detailed)
        self._last = (tracked, shapes, ready, detailed, key)
        return key

    def _computation(self, variables: list[Any], groups: list[Group], ready: list[bool],
                     detailed: bool) -> Callable[..., tf.Tensor]:
        """Every fingerprint of ``variables`` (in ``groups``; ``ready``: initialized) as one
        int64 vector, laid out as ``_unpack`` reads it; run eagerly or traced, with the
        variables as arguments (the computation keeps no reference to them)."""
        hasher = self.hasher
        initialized = dict(enumerate(ready))
        folded: dict[Group, FoldedGroup] | None = None
        hashed = [v for v, g in zip(variables, groups, strict=True) if g in _GROUPS]
        if not detailed and foldable(hashed):  # a few ops per group (statefold.py)
            folded = {g: FoldedGroup(
                [v for v, h in zip(variables, groups, strict=True) if h == g],
                [r for r, h in zip(ready, groups, strict=True) if h == g],
                hasher.keys) for g in _GROUPS}
        # per-variable contents: all of them, or with folded groups the generators' only
        singles = [i for i, g in enumerate(groups) if folded is None or g == Group.DATA]

        def bits(x: tf.Tensor) -> tf.Tensor:
            return tf.bitcast(x, tf.int64)

        def compute(*everyone: Any) -> tf.Tensor:
            # each variable read once (a read is an op, and the float sum reads parameters too)
            values = [v.value() if initialized[i] else None
                      for i, v in enumerate(everyone)]

            def value(i: int) -> tf.Tensor:
                got = values[i]
                return got if got is not None else tf.zeros(everyone[i].shape,
                                                            everyone[i].dtype)

            def content(i: int) -> tf.Tensor:
                got = values[i]
                return hasher.content(got) if got is not None else tf.constant(0, tf.int64)

            members = {g: [i for i, h in enumerate(groups) if h == g] for g in _GROUPS}
            rngs = [i for i, h in enumerate(groups) if h == Group.DATA]
            floats = [i for i, (v, h) in enumerate(zip(everyone, groups, strict=True))
                      if h == Group.PARAM and v.dtype.is_floating]
            contents = {i: content(i) for i in singles}
            out = []
            for group in _GROUPS:
                ids = members[group]
                if not ids:
                    out.append(tf.constant(0, tf.int64))
                    continue
                if folded is not None:
                    out.append(folded[group].content([values[i] for i in ids]))
                    continue
                weights = tf.constant(chunk_keys(len(ids)), tf.int64)
                # int64 products and sums wrap modulo 2**64, as the definition wants
                out.append(tf.reduce_sum(tf.stack([contents[i] for i in ids]) * weights))
            out.extend(contents[i] for i in rngs)
            out.append(bits(tf.add_n([tf.reduce_sum(tf.cast(value(i), tf.float64))
                                      for i in floats]) if floats
                            else tf.constant(math.nan, tf.float64)))
            if detailed:
                for i, v in enumerate(everyone):
                    wide = tf.cast(value(i), tf.float64) if v.dtype.is_floating \
                        else tf.zeros([1], tf.float64)
                    largest = tf.reduce_max(tf.abs(wide)) if v.dtype.is_floating \
                        else tf.constant(math.nan, tf.float64)
                    out.extend([contents[i], bits(tf.reduce_sum(wide)), bits(largest),
                                tf.size(v, out_type=tf.int64)])
            return tf.stack(out)

        return compute


def _call(function: Any, variables: list[Any]) -> tf.Tensor:
    """``function(*variables)``, with plain resource variables through the concrete
    function's flat call (their handles): binding a few dozen variable arguments to the
    traced signature took a quarter of the state hash's time on the narrow model. Optimizer
    slots made in a function's first trace (``UnliftedInitializerVariable``, an
    ``UninitializedVariable``) count as plain: with them (Keras' Adam) every call took the
    public one, ~0.2 ms more per hash (docs/benchmarks.md, TensorFlow, "Ninth round").
    Other variables (a strategy's distributed ones flatten differently), or a TensorFlow
    whose concrete functions lack the flat call, take the public call."""
    flat = getattr(function, "_call_flat", None)
    if flat is not None and all(isinstance(v, _PLAIN) for v in variables):
        try:
            return flat([v.handle for v in variables], function.captured_inputs)
        except (TypeError, AttributeError):  # the private call changed: the public one
            pass
    return function(*variables)


_PLAIN = (ResourceVariable, UninitializedVariable)


def _meta(v: Any) -> tuple[int, ...]:
    dims = [-1 if d is None else int(d) for d in v.shape.as_list()] \
        if v.shape.rank is not None else []
    return (name_code(v.dtype.name), len(dims), *dims)


def _group_fp(content: int, vs: list[Any]) -> int:
    """A group's fingerprint: its content with every member's dtype and shape (0: empty)."""
    if not vs:
        return 0
    return combine((content, *(m for v in vs for m in _meta(v))))


def _fp(content: int, meta: tuple[int, ...]) -> int:
    """A group's fingerprint from its content and members' metas (0: no members)."""
    return combine((content, *meta)) if meta else 0


def _unpack(values: np.ndarray, live: list[tuple[TrackedVariable, Any]], metas: _Metas,
            detailed: bool) -> StepState:
    rngs = metas.rngs
    ints = [int(x) for x in values.tolist()]
    floats = values.view(np.float64)
    at = len(_GROUPS) + len(rngs)
    state = StepState(
        params=_fp(ints[0], metas.groups[Group.PARAM]),
        buffers=_fp(ints[1], metas.groups[Group.BUFFER]),
        optim=_fp(ints[2], metas.groups[Group.OPTIM]),
        params_sum=float(floats[at]),
        rng=[_fp(c, m) for c, m in zip(ints[len(_GROUPS):at], rngs, strict=True)],
    )
    if detailed:
        order = {Group.PARAM: 0, Group.BUFFER: 1, Group.OPTIM: 2, Group.DATA: 3}
        rows = []
        for i, (tracked, v) in enumerate(live):
            base = at + 1 + i * _PER_VARIABLE
            size = ints[base + 3]
            floating = v.dtype.is_floating
            rows.append((order[tracked.group], i, TensorRow(
                tracked.group, f"variable {tracked.name}", _group_fp(ints[base], [v]),
                float(floats[base + 1]) if floating else math.nan,
                float(floats[base + 2]) if floating and size else math.nan, size)))
        state.tensors.extend(row for _, _, row in sorted(rows, key=lambda r: r[:2]))
    return state
