"""Step-level state of a TensorFlow run hashed where the variables live.

At each step end every tracked variable is fingerprinted by a ``tf.function`` (traced once
per set of variables) that returns all the step row needs as one int64 vector: one
content sum per group (parameters, buffers, optimizer state), one per random-generator
state, the parameters' float64 sum and, in detailed steps, each variable's content, sum,
largest magnitude and size. The vector is read back once per step; no variable is copied
to the host. A group's content is ``sum_i content_i * chunk_keys[i]`` mod 2**64 (the same
weighting as chunks in Note [Fingerprint definition]), its fingerprint that content
combined with every member's dtype and shape.
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


class StateHasher:
    """Fingerprints of the tracked variables, computed in-graph (module docstring)."""

    def __init__(self, hasher: GraphHasher) -> None:
        self.hasher = hasher
        self._key: tuple[Any, ...] | None = None
        self._function: Callable[..., tf.Tensor] | None = None

    def state(self, tracked: list[tuple[TrackedVariable, Any]], detailed: bool) -> StepState:
        """The step-level state of the live tracked variables (those of a dtype that can be
        hashed; a variable not yet initialized counts as zeros)."""
        live = [(t, v) for t, v in tracked if getattr(v, "dtype", None) in HASHABLE]
        # The function depends only on each variable's group, dtype and shape; the
        # variables are passed as arguments, so it holds no reference to them.
        key = (tuple((int(t.group), v.dtype.name, str(v.shape)) for t, v in live), detailed)
        if key != self._key or self._function is None:
            self._function = self._build([t.group for t, _ in live], detailed)
            self._key = key
        values = to_host(self._function(*(v for _, v in live)))
        return _unpack(values, live, detailed)

    def _build(self, groups: list[Group], detailed: bool) -> Callable[..., tf.Tensor]:
        hasher = self.hasher

        def content(v: Any) -> tf.Tensor:
            return tf.cond(v.is_initialized(), lambda: hasher.content(v.read_value()),
                           lambda: tf.constant(0, tf.int64))

        def total(v: Any) -> tf.Tensor:
            return tf.reduce_sum(tf.cast(v.read_value(), tf.float64))

        def bits(x: tf.Tensor) -> tf.Tensor:
            return tf.bitcast(x, tf.int64)

        def compute(*everyone: Any) -> tf.Tensor:
            members = {g: [v for v, h in zip(everyone, groups, strict=True) if h == g]
                       for g in _GROUPS}
            rngs = [v for v, h in zip(everyone, groups, strict=True) if h == Group.DATA]
            floats = [v for v in members[Group.PARAM] if v.dtype.is_floating]
            contents = {id(v): content(v) for v in everyone}
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
            out.append(bits(tf.add_n([total(v) for v in floats]) if floats
                            else tf.constant(math.nan, tf.float64)))
            if detailed:
                for v in everyone:
                    value = tf.cast(v.read_value(), tf.float64) if v.dtype.is_floating \
                        else tf.zeros([1], tf.float64)
                    largest = tf.reduce_max(tf.abs(value)) if v.dtype.is_floating \
                        else tf.constant(math.nan, tf.float64)
                    out.extend([contents[id(v)], bits(tf.reduce_sum(value)), bits(largest),
                                tf.size(v, out_type=tf.int64)])
            return tf.stack(out)

        return tf.function(compute, autograph=False)  # type: ignore[no-any-return]


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
