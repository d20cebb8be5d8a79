"""TensorFlow fingerprints equal the NumPy (host) and torch ones for the same bytes, in
eager code and inside graphs whose shapes are only known when they run."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from nondet.fingerprint import CHUNK_WORDS, MASK64  # noqa: E402
from nondet.frameworks.tensorflow.hashing import GraphHasher, host, static_plan  # noqa: E402

HASHER = GraphHasher()
DTYPES = [tf.bool, tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
          tf.float32, tf.float64, tf.complex64, tf.complex128]
# word sizes change with the byte count (8, 4, else 1); several chunks past CHUNK_WORDS
SIZES = [1, 3, 6, 7, 64, CHUNK_WORDS * 2 + 5]


def _sample(dtype: tf.DType, n: int) -> tf.Tensor:
    base = np.random.default_rng(n).normal(size=n) * 50
    if dtype == tf.bool:
        return tf.constant(base > 0)
    if dtype.is_complex:
        return tf.cast(tf.complex(base, base[::-1].copy()), dtype)
    return tf.cast(tf.constant(base), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("n", SIZES)
def test_graph_host_and_unknown_shape_paths_agree(dtype: tf.DType, n: int) -> None:
    t = _sample(dtype, n)
    eager = int(HASHER.content(t).numpy()) & MASK64
    assert eager == host(t) & MASK64
    unknown = tf.function(HASHER.content).get_concrete_function(
        tf.TensorSpec([None], dtype))
    assert int(unknown(t).numpy()) & MASK64 == eager


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("n", SIZES)
def test_planned_path_agrees(dtype: tf.DType, n: int) -> None:
    """The op guards trace the hash once per (dtype, plan) for tensors of any shape: the
    plan read from the static shape gives the same number without knowing it."""
    t = tf.reshape(_sample(dtype, n), [1, n])
    plan = static_plan(t)
    assert plan is not None
    planned = tf.function(lambda x: HASHER.content_planned(x, plan)).get_concrete_function(
        tf.TensorSpec(None, dtype))
    assert int(planned(t).numpy()) & MASK64 == host(t) & MASK64


def test_every_position_and_order_counts() -> None:
    t = tf.range(100, dtype=tf.float32)
    base = host(t)
    assert host(tf.reverse(t, [0])) != base  # a permutation (xor hashes miss this)
    changed = tf.tensor_scatter_nd_update(t, [[57]], [57.000004])
    assert host(changed) != base


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16", "bool", "uint8"])
def test_same_bytes_same_fingerprint_as_torch(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    from nondet.frameworks.torch.hashing import TorchHasher

    values = np.random.default_rng(1).normal(size=(37, 5)) * 10
    array = values > 0 if dtype == "bool" else values.astype(dtype)
    tf_value = int(HASHER.content(tf.constant(array)).numpy()) & MASK64
    torch_value = TorchHasher().content(torch.from_numpy(np.ascontiguousarray(array)))
    assert tf_value == int(torch_value) & MASK64


def test_the_guard_branch_is_a_few_graph_nodes() -> None:
    """The op-level guard's branch runs for every hashed output of a captured step: the
    words of a one-chunk tensor are one reshape and bitcast, its slot a scalar update
    (30 graph nodes before, 20 after; the same number: test_planned_path_agrees). The sum
    as a 1xN by Nx1 int64 MatMul adds three reshapes and their shapes (26): cheaper to run
    than the multiply and sum it replaced (docs/benchmarks.md, TensorFlow, sixth round)."""
    from nondet.frameworks.tensorflow.graph import RecorderVariables

    variables = RecorderVariables(True)
    for dtype, plan in ((tf.float32, (8, False)), (tf.float32, (4, False)),
                        (tf.int64, (8, False))):
        then, _ = variables.guard(dtype, plan)
        assert len(then.graph.as_graph_def().node) <= 26, (dtype, plan)


@pytest.mark.parametrize("gpus", [False, True], ids=["matmul", "multiply-and-sum"])
def test_both_dot_paths_give_the_host_number(gpus: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The content sum is an int64 MatMul on the CPU and a multiply and sum where a GPU is
    visible: both wrap modulo 2**64 to the host's number (keys near 2**63 overflow)."""
    from nondet.frameworks.tensorflow import hashing

    monkeypatch.setattr(hashing, "_gpus", lambda: gpus)
    for n in (0, 1, 5, 4099):
        t = _sample(tf.float64, n)
        plan = static_plan(t)
        traced = tf.function(lambda x, plan=plan: HASHER.content_planned(x, plan),
                             autograph=False, input_signature=[tf.TensorSpec(None, t.dtype)])
        assert int(traced(t)) & MASK64 == host(t), n


@pytest.mark.parametrize("dtype", [tf.bool, tf.int16, tf.float32, tf.float64, tf.complex64],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("known", [[None, 2], [None, 3], [2, None], [None, 1, 5], None])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, (CHUNK_WORDS * 2) // 3 + 1])
def test_partly_known_shapes_agree(dtype: tf.DType, known: list[int | None] | None,
                                   rows: int) -> None:
    """A batch of any length (a data input of a Keras ``fit``): the word size is settled
    from the dimensions known when tracing where they allow it, and one loop serves one
    chunk or several; the number is the host's for every byte count."""
    shape = [rows if d is None else d for d in (known or [None])]
    t = tf.reshape(_sample(dtype, int(np.prod(shape))), shape)
    traced = tf.function(HASHER.content).get_concrete_function(tf.TensorSpec(known, dtype))
    assert int(traced(t).numpy()) & MASK64 == host(t) & MASK64


def test_a_batch_of_unknown_length_traces_no_branches() -> None:
    """A float32 image batch's word size is known from its other dimensions: its hash is
    one loop (two graph functions), not a ``tf.cond`` per word size and chunk count."""
    traced = tf.function(HASHER.content).get_concrete_function(
        tf.TensorSpec([None, 28, 28, 1], tf.float32))
    assert len(traced.graph.as_graph_def().library.function) <= 2


@pytest.mark.parametrize("n", [1, 3, 64])
def test_strings_are_hashed_by_content_on_every_path(n: int) -> None:
    """Note [Strings] (trial round 19): a string batch that differed was not hashed, so the
    ``StringLookup`` reading it was blamed as if its inputs had matched."""
    from nondet.frameworks.tensorflow.hashing import hashable

    words = tf.constant([f"user{i}" for i in range(n)])
    assert hashable(words)
    eager = int(HASHER.content(words).numpy()) & MASK64
    assert eager == host(words) & MASK64
    unknown = tf.function(HASHER.content).get_concrete_function(tf.TensorSpec([None], tf.string))
    assert int(unknown(words).numpy()) & MASK64 == eager
    shaped = tf.reshape(words, [1, n])
    plan = static_plan(shaped)
    planned = tf.function(lambda x: HASHER.content_planned(x, plan)).get_concrete_function(
        tf.TensorSpec(None, tf.string))
    assert int(planned(shaped).numpy()) & MASK64 == host(shaped) & MASK64
    other = tf.constant([f"user{i}" for i in reversed(range(n))] if n > 1 else ["user9"])
    assert host(other) != host(words)  # another order, or another string: another number
