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
from typing import Any

import numpy as np
import tensorflow as tf

from nondet.fingerprint import chunk_keys, combine, name_code
from nondet.frameworks.base import StepState, TensorRow
from nondet.frameworks.tensorflow.graph import to_host
from nondet.frameworks.tensorflow.hashing import HASHABLE, GraphHasher
from nondet.frameworks.tensorflow.state import TrackedVariable
from nondet.records import Group

_GROUPS = (Group.PARAM, Group.BUFFER, Group.OPTIM)
#: Per variable in detailed steps: content, float64 sum, float64 largest magnitude, size.
_PER_VARIABLE = 4
#: Traced state functions kept (one per variable set and detail level; a run has two or three).
_KEPT_FUNCTIONS = 8


class StateHasher:
    """Fingerprints of the tracked variables, computed in-graph (module docstring)."""

    def __init__(self, hasher: GraphHasher) -> None:
        self.hasher = hasher
        # per variable set (and detail level) seen: its traced function, once called twice
        self._functions: dict[tuple[Any, ...], Callable[..., tf.Tensor] | None] = {}

    def state(self, tracked: list[tuple[TrackedVariable, Any]], detailed: bool) -> StepState:
        """The step-level state of the live tracked variables (those of a dtype that can be
        hashed; a variable not yet initialized counts as zeros)."""
        live = [(t, v) for t, v in tracked if getattr(v, "dtype", None) in HASHABLE]
        for t, v in live:
            if not t.initialized:  # asked until true: a variable never becomes uninitialized
                t.initialized = bool(v.is_initialized())
        ready = [t.initialized for t, _ in live]
        # The computation depends only on each variable's group, dtype, shape and whether it
        # is initialized; the variables are passed as arguments, so it holds no reference.
        key = (tuple((int(t.group), v.dtype.name, str(v.shape), t.initialized)
                     for t, v in live), detailed)
        variables = [v for _, v in live]
        groups = [t.group for t, _ in live]
        if key not in self._functions:  # a new set: eager this once (module docstring)
            if len(self._functions) >= _KEPT_FUNCTIONS:  # the sets keep changing
                self._functions.clear()
            self._functions[key] = None
            values = to_host(self._computation(groups, ready, detailed)(*variables))
        else:
            function = self._functions[key]
            if function is None:
                # Kept as the concrete function and called directly: a tf.function call
                # first matches every argument against its traced signatures, which with a
                # few dozen variables cost ~40% of the whole hash (CPU time per step on
                # bench/model_tf.py: 4.4 -> 2.8 ms narrow, 6.9 -> 5.0 ms reference).
                function = tf.function(self._computation(groups, ready, detailed),
                                       autograph=False).get_concrete_function(*variables)
                self._functions[key] = function
            values = to_host(function(*variables))
        return _unpack(values, live, detailed)

    def _computation(self, groups: list[Group], ready: list[bool],
                     detailed: bool) -> Callable[..., tf.Tensor]:
        """Every fingerprint of variables in ``groups`` (``ready``: initialized) as one int64
        vector, laid out as ``_unpack`` reads it; run eagerly or traced."""
        hasher = self.hasher
        initialized = dict(enumerate(ready))

        def value(i: int, v: Any) -> tf.Tensor:
            return v.read_value() if initialized[i] else tf.zeros(v.shape, v.dtype)

        def content(i: int, v: Any) -> tf.Tensor:
            return hasher.content(v.read_value()) if initialized[i] \
                else tf.constant(0, tf.int64)

        def bits(x: tf.Tensor) -> tf.Tensor:
            return tf.bitcast(x, tf.int64)

        def compute(*everyone: Any) -> tf.Tensor:
            members = {g: [v for v, h in zip(everyone, groups, strict=True) if h == g]
                       for g in _GROUPS}
            rngs = [v for v, h in zip(everyone, groups, strict=True) if h == Group.DATA]
            floats = [(i, v) for i, (v, h) in enumerate(zip(everyone, groups, strict=True))
                      if h == Group.PARAM and v.dtype.is_floating]
            contents = {id(v): content(i, v) for i, v in enumerate(everyone)}
            out = []
            for group in _GROUPS:
                vs = members[group]
                if not vs:
                    out.append(tf.constant(0, tf.int64))
                    continue
                weights = tf.constant(chunk_keys(len(vs)), tf.int64)
                # int64 products and sums wrap modulo 2**64, as the definition wants
                out.append(tf.reduce_sum(tf.stack([contents[id(v)] for v in vs]) * weights))
            out.extend(contents[id(v)] for v in rngs)
            out.append(bits(tf.add_n([tf.reduce_sum(tf.cast(value(i, v), tf.float64))
                                      for i, v in floats]) if floats
                            else tf.constant(math.nan, tf.float64)))
            if detailed:
                for i, v in enumerate(everyone):
                    wide = tf.cast(value(i, v), tf.float64) if v.dtype.is_floating \
                        else tf.zeros([1], tf.float64)
                    largest = tf.reduce_max(tf.abs(wide)) if v.dtype.is_floating \
                        else tf.constant(math.nan, tf.float64)
                    out.extend([contents[id(v)], bits(tf.reduce_sum(wide)), bits(largest),
                                tf.size(v, out_type=tf.int64)])
            return tf.stack(out)

        return compute


def _meta(v: Any) -> tuple[int, ...]:
    dims = [-1 if d is None else int(d) for d in v.shape.as_list()] \
        if v.shape.rank is not None else []
    return (name_code(v.dtype.name), len(dims), *dims)


def _group_fp(content: int, vs: list[Any]) -> int:
    """A group's fingerprint: its content with every member's dtype and shape (0: empty)."""
    if not vs:
        return 0
    return combine((content, *(m for v in vs for m in _meta(v))))


def _unpack(values: np.ndarray, live: list[tuple[TrackedVariable, Any]],
            detailed: bool) -> StepState:
    members = {g: [v for t, v in live if t.group == g] for g in _GROUPS}
    rngs = [v for t, v in live if t.group == Group.DATA]
    ints = [int(x) for x in values.tolist()]
    floats = values.view(np.float64)
    at = len(_GROUPS) + len(rngs)
    state = StepState(
        params=_group_fp(ints[0], members[Group.PARAM]),
        buffers=_group_fp(ints[1], members[Group.BUFFER]),
        optim=_group_fp(ints[2], members[Group.OPTIM]),
        params_sum=float(floats[at]),
        rng=[_group_fp(c, [v]) for c, v in zip(ints[len(_GROUPS):at], rngs, strict=True)],
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
