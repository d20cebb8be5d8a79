"""Loops that run iterations at once and draw from a legacy random op
(frameworks/tensorflow/loops.py): which loops are named, and the intervention that runs
them one iteration at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.framework import op_callbacks  # noqa: E402
from tensorflow.python.ops import while_v2  # noqa: E402

from nondet.frameworks.tensorflow import loops  # noqa: E402


def _loops_traced(function: Callable[..., Any], *args: Any) -> list[tuple[str, int] | None]:
    """What ``parallel_random_draws`` says of each loop op traced by ``function``."""
    seen: list[tuple[str, int] | None] = []

    def callback(op_type: Any, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None,
                 graph: Any = None) -> None:
        op_type = op_type.decode() if isinstance(op_type, bytes) else op_type
        if op_type in loops.LOOP_OPS:
            seen.append(loops.parallel_random_draws(op_type, attrs))

    op_callbacks.add_op_callback(callback)
    try:
        tf.function(function).get_concrete_function(*args)
    finally:
        op_callbacks.remove_op_callback(callback)
    return seen


X = tf.TensorSpec([8, 4], tf.float32)


def test_a_map_fn_drawing_legacy_noise_in_parallel_is_named() -> None:
    found = _loops_traced(lambda x: tf.map_fn(lambda r: r + tf.random.normal([4]), x), X)
    assert found == [("RandomStandardNormal", 10)]


def test_a_draw_in_a_branch_of_the_body_is_found() -> None:
    def body(x: Any) -> Any:
        return tf.map_fn(lambda r: tf.cond(r[0] > 0, lambda: r + tf.random.uniform([4]),
                                           lambda: r), x, parallel_iterations=4)
    assert _loops_traced(body, X) == [("RandomUniform", 4)]


def test_loops_that_draw_in_order_are_not_named() -> None:
    generator = tf.random.Generator.from_seed(0)
    cases = [
        lambda x: tf.map_fn(lambda r: r + tf.random.normal([4]), x, parallel_iterations=1),
        lambda x: tf.map_fn(lambda r: r + generator.normal([4]), x),  # a resource: in order
        lambda x: tf.map_fn(lambda r: r * 2.0, x),
        lambda x: tf.map_fn(lambda r: r + tf.random.stateless_normal([4], seed=[1, 2]), x),
    ]
    for case in cases:
        assert _loops_traced(case, X) == [None]


def test_other_ops_and_odd_attributes_are_never_named() -> None:
    assert loops.parallel_random_draws("MatMul", ()) is None
    assert loops.parallel_random_draws("While", ("parallel_iterations", "ten")) is None
    assert loops.parallel_random_draws("While", None) is None


@pytest.fixture
def sequential() -> Iterator[None]:
    original = while_v2.while_loop
    loops.sequential_loops()
    try:
        yield
    finally:
        while_v2.while_loop = original


def test_the_intervention_builds_every_loop_with_one_iteration_at_a_time(
        sequential: None) -> None:
    draws = lambda x: tf.map_fn(lambda r: r + tf.random.normal([4]), x)  # noqa: E731
    assert _loops_traced(draws, X) == [None]  # parallel_iterations=1: nothing to name

    def by_position(x: Any) -> Any:  # parallel_iterations given by position
        return while_v2.while_loop(lambda i: i < 3, lambda i: i + 1, [0], None, 8)
    graph = tf.function(by_position).get_concrete_function(X).graph
    whiles = [op for op in graph.get_operations() if op.type in loops.LOOP_OPS]
    assert [op.get_attr("parallel_iterations") for op in whiles] == [1]

