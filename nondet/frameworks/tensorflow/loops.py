"""Legacy random ops inside loops that run several iterations at once.

``tf.while_loop`` runs up to ``parallel_iterations`` iterations at once (10 by default in a
traced function), and so do the loops built on it: ``tf.map_fn`` (per-example augmentation
in a ``tf.function``), ``tf.scan``, AutoGraph's ``for``/``while`` over tensors. A legacy
stateful random op in the body (``tf.random.normal``, ``tf.random.uniform``... without a
``tf.random.Generator``) keeps one internal state for all iterations, so which iteration
gets which numbers depends on which reaches the op first: the results differ between runs
(measured on TF 2.21: 3 to 5 outcomes in 30 calls of a 64-row ``map_fn``). Variables and
``tf.random.Generator`` draws are resources, which TensorFlow orders (1 outcome in 30).

Such a race often does not strike in two runs side by side (nondet's lockstep runs one at
a time), so the loop is named at trace time, where its ``While`` op is built: a capture
note with the loop's line, shown with every report (``PARALLEL_DRAWS_NOTE``). When it does
strike, the difference first shows in what reads the loop's outputs; a loop's
``TensorList`` output cannot be hashed, so its reader would look like an op creating a
difference from matching inputs. The graph recorder names such a reader after the loop
(``traced``), whose recipe (``TF-WHILE``) is verified by ``tf.sequential_loops``: every
loop built with ``parallel_iterations=1`` (``sequential_loops``).
"""

from __future__ import annotations

import functools
from typing import Any

#: Stateful random ops with no resource input: one hidden state shared by every caller
#: (the ``tf.random.Generator`` ops read a resource, which TensorFlow orders).
LEGACY_RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomShuffle", "RandomGamma", "RandomPoisson",
    "RandomPoissonV2", "Multinomial", "RandomCrop", "SampleDistortedBoundingBox",
    "SampleDistortedBoundingBoxV2",
})
#: The op types of a loop.
LOOP_OPS = frozenset({"While", "StatelessWhile"})
_MAX_NESTING = 8
#: ``while_v2.while_loop(cond, body, loop_vars, shape_invariants, parallel_iterations, ...)``
_PARALLEL_ITERATIONS_AT = 4

#: Capture note key prefix and text (``capture_note.<key>``).
NOTE_KEY = "tf_parallel_loop_draws"
PARALLEL_DRAWS_NOTE = (
    "the loop at {source} (a tf.while_loop, tf.map_fn or AutoGraph loop) runs up to "
    "{iterations} iterations at once, and its body draws from {op}, a random op whose state "
    "every iteration shares: which iteration gets which numbers depends on thread timing, "
    "so its results can differ between runs even when two runs agree; draw the numbers "
    "before the loop, or use tf.random.Generator or stateless random ops seeded per "
    "iteration, or give the loop parallel_iterations=1")


def _attr(attrs: Any, name: str) -> Any:
    """An attribute of a graph op from TensorFlow's op callback (name, value, name, ...)."""
    pairs = dict(zip(attrs[::2], attrs[1::2], strict=False)) if attrs else {}
    return pairs.get(name)


def parallel_random_draws(op_type: str, attrs: Any) -> tuple[str, int] | None:
    """(the legacy random op, parallel iterations) when ``op_type`` with ``attrs`` is a
    loop that runs several iterations at once and whose body draws from a legacy random op;
    else None. Never raises."""
    if op_type not in LOOP_OPS:
        return None
    try:
        iterations = int(getattr(_attr(attrs, "parallel_iterations"), "i", 1))
        body = getattr(getattr(_attr(attrs, "body"), "func", None), "name", None)
        if iterations <= 1 or not body:
            return None
        found = _legacy_random_op(str(body))
        return (found, iterations) if found else None
    except Exception:  # a function TF no longer holds: this is only about a note
        return None


def _legacy_random_op(name: str, depth: int = 0) -> str | None:
    """The first legacy random op in function ``name`` or one it runs (a branch, a call,
    a nested loop's body), or None."""
    from tensorflow.python.eager import context
    from tensorflow.python.framework import op_def_registry

    function = context.context().get_function_def(name)
    if not function.signature.is_stateful or depth >= _MAX_NESTING:
        return None  # nothing stateful inside, nested functions included
    for node in function.node_def:
        if node.op in LEGACY_RANDOM_OPS:
            return str(node.op)
        nested = [a.func.name for a in node.attr.values() if a.HasField("func")]
        nested += [f.name for a in node.attr.values() if a.HasField("list") for f in a.list.func]
        if op_def_registry.get(node.op) is None:  # a function called by its name
            nested.append(node.op)
        for inner in nested:
            try:
                found = _legacy_random_op(inner, depth + 1)
            except Exception:
                continue
            if found:
                return found
    return None


def loop_producer(t: Any) -> Any:
    """The control-flow op (a loop, a branch, a call) whose output ``t`` is, looking
    through identities; None for any other op's."""
    from nondet.frameworks.tensorflow.graph import CONTROL_FLOW_OPS

    op = getattr(t, "op", None)
    for _ in range(_MAX_NESTING):
        if op is None:
            return None
        if op.type in CONTROL_FLOW_OPS:
            return op
        if op.type != "Identity" or not op.inputs:
            return None
        op = op.inputs[0].op
    return None


def sequential_loops() -> None:
    """The ``tf.sequential_loops`` intervention: every loop a traced function builds
    (``tf.while_loop``, ``tf.map_fn``, ``tf.scan``, AutoGraph's) runs one iteration at a
    time. They all reach ``while_v2.while_loop``, looked up on its module at each call."""
    from tensorflow.python.ops import while_v2

    original = while_v2.while_loop

    @functools.wraps(original)
    def while_loop(*args: Any, **kwargs: Any) -> Any:
        if len(args) > _PARALLEL_ITERATIONS_AT:  # given by position
            args = (*args[:_PARALLEL_ITERATIONS_AT], 1, *args[_PARALLEL_ITERATIONS_AT + 1:])
        else:
            kwargs["parallel_iterations"] = 1
        return original(*args, **kwargs)

    while_v2.while_loop = while_loop
