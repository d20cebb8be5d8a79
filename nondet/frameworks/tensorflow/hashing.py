"""TensorFlow fingerprints: Note [Fingerprint definition] as TF ops (inside graphs and on
accelerators) and through NumPy for eager CPU tensors. Both give the same number as the
torch implementations for the same bytes; tests check all of them against each other.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import tensorflow as tf

from nondet.fingerprint import CHUNK_WORDS, chunk_keys, host_content, position_keys, word_size
from nondet.frameworks.fp import narrow_host_words

#: TF dtypes whose values can be fingerprinted (numbers and booleans).
HASHABLE = frozenset({
    tf.bool, tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32,
    tf.uint64, tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128,
})
_INT_OF_SIZE = {1: tf.uint8, 2: tf.int16, 4: tf.int32, 8: tf.int64}

#: Note [Strings]
#: String tensors (ids, tokens, file names a tf.data pipeline hands the model) are hashed
#: as one int64 per string, its 64-bit FarmHash fingerprint (``StringToHashBucketFast``,
#: stable across processes and versions) modulo this. They were not hashed at all, so the
#: first op reading a string batch that differed (a ``StringLookup``'s table lookup)
#: looked as if every input had matched and was blamed (trial round 19).
_STRING_BUCKETS = 2**63 - 1


def hashable(t: Any) -> bool:
    """A dense tensor of a dtype we can hash (sparse and ragged values are composites of
    dense tensors, hashed where their components are made)."""
    return isinstance(t, tf.Tensor) and (t.dtype in HASHABLE or t.dtype == tf.string)


def _numbers(t: tf.Tensor) -> tf.Tensor:
    """``t`` itself, or a string tensor's int64 fingerprints, same shape (Note [Strings])."""
    if t.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(t, _STRING_BUCKETS)
    return t


def _element_bytes(t: Any) -> int:
    """Bytes per element as hashed: 8 for a string (its fingerprint)."""
    return 8 if t.dtype == tf.string else int(t.dtype.size)


_eager_hasher: GraphHasher | None = None


def on_host_and_small(t: Any) -> bool:
    """An eager tensor that NumPy can hash right away: in host memory, at most a chunk
    (``.numpy()`` copies the whole tensor)."""
    return ("CPU" in (getattr(t, "device", "") or "CPU")
            and _element_bytes(t) * (t.shape.num_elements() or 0) <= CHUNK_WORDS * 8)


def host(t: Any) -> int:
    """Content sum of an eager tensor via NumPy (CPU). ``.numpy()`` copies the whole tensor:
    tensors over a chunk are hashed with TF ops instead, chunk by chunk (the same number)."""
    global _eager_hasher
    t = _numbers(t)
    if t.dtype.size * (t.shape.num_elements() or 0) > CHUNK_WORDS * 8:
        if _eager_hasher is None:  # made on first need: it holds a chunk of keys
            _eager_hasher = GraphHasher()
        return int(_eager_hasher.content(t).numpy())
    return host_content([narrow_host_words(np.asarray(t.numpy()))])


class GraphHasher:
    """Builds the in-graph fingerprint of a tensor: an int64 scalar computed on its device.

    Keys live in non-trainable variables created once (outside any graph), so graphs read
    them instead of embedding megabytes of constants. Words are widened to int64 one chunk
    at a time inside a loop: the extra memory is a few chunks whatever the tensor's size
    (widening or padding the whole tensor took up to 16 times its bytes).
    """

    def __init__(self) -> None:
        with tf.init_scope():
            self.keys = tf.Variable(position_keys(CHUNK_WORDS), trainable=False,
                                    name="nondet_keys")
            self.chunk_keys = tf.Variable(chunk_keys(4096), trainable=False,
                                          name="nondet_chunk_keys")

    def content(self, t: tf.Tensor) -> tf.Tensor:
        return _words(_numbers(t), self._sum)

    # plain ops: nothing for autograph to change (it mis-converted the helpers it calls)
    @tf.autograph.experimental.do_not_convert  # type: ignore[untyped-decorator]
    def content_planned(self, t: tf.Tensor, plan: Plan) -> tf.Tensor:
        """``content(t)`` for a tensor whose static shape gave ``plan`` (``static_plan``),
        traced without knowing the shape: the same number, with no branch on the size."""
        word, chunked = plan
        t = _numbers(t)
        words = None if chunked else _direct_words(t, word)
        if words is None:
            return _as_words(_flat(t), word, lambda w: self._sum(w, chunked))
        # One chunk, words made in one reshape and bitcast: the op-level guard's branch runs
        # this for every hashed output of every captured step, and its dozen fewer graph
        # nodes (no flat copy, no size, no strided-slice bounds) are ~4 us per output.
        keys = tf.slice(self.keys, tf.zeros([1], tf.int64), tf.shape(words, out_type=tf.int64))
        return _dot(_widen(words), keys)

    def _sum(self, words: tf.Tensor, chunked: bool | None = None) -> tf.Tensor:
        """Content sum of narrow words (uint8, int32 or int64), chunk by chunk; ``chunked``:
        known in advance whether there is more than one chunk (else from the size)."""
        n = tf.size(words, out_type=tf.int64)
        static = _static_size(words)
        if static is not None:  # known when tracing: no loop needed for one chunk
            chunked = static > CHUNK_WORDS
        if chunked is False:
            return _dot(_widen(words), self.keys[:n])
        # Note [One loop for any size]: a tensor whose size is known only when the graph
        # runs (a batch of any length) goes through the chunk loop whatever its size, a
        # single chunk unweighted, as the definition has it. A ``tf.cond`` on the size over
        # the one-chunk dot and this loop made four graph functions per hashed tensor, each
        # traced and instantiated: for a (None, 28, 28, 1) float32 batch the trace and
        # first call took 111 ms with the cond and 56 ms with the loop alone, and a call
        # 0.38 ms against 0.24 (this Xeon, 2026-11-29; `_words` had already settled the
        # word size, which saves more: 440 ms when three word sizes were left open). A Keras
        # ``fit`` hashes two such inputs in each function it traces (train, test).
        chunks = (n + CHUNK_WORDS - 1) // CHUNK_WORDS
        several = chunks > 1

        def body(i: tf.Tensor, acc: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            start = i * CHUNK_WORDS
            size = tf.minimum(n - start, CHUNK_WORDS)
            partial = _dot(_widen(tf.slice(words, [start], [size])), self.keys[:size])
            weight = tf.where(several, self.chunk_keys[i], tf.constant(1, tf.int64))
            return i + 1, acc + partial * weight

        zero = tf.constant(0, tf.int64)
        _, total = tf.while_loop(lambda i, _: i < chunks, body, (zero, zero),
                                 parallel_iterations=1)
        return total


@functools.cache
def _gpus() -> bool:
    """A GPU is visible (asked once: the runtime is up by the time anything is hashed)."""
    return bool(tf.config.list_logical_devices("GPU"))


def _dot(words: tf.Tensor, keys: tf.Tensor, device: str | None = None) -> tf.Tensor:
    """sum(words * keys) modulo 2**64 (int64 words and keys). On the CPU as a 1xN by Nx1
    int64 matrix product: no N-word temporary, 0.6 of the time of a multiply then a sum
    (the op-level guards' hashes of the narrow model, docs/benchmarks.md); elsewhere as
    the multiply and sum (GPUs have no int64 MatMul). ``device``: where the words are;
    None: not known when tracing (a guard branch shared by all outputs), so the multiply
    and sum whenever a GPU is visible."""
    if _gpus() if device is None else "GPU" in device.upper():
        return tf.reduce_sum(words * keys)
    product = tf.matmul(tf.reshape(words, [1, -1]), tf.reshape(keys, [-1, 1]))
    return tf.reshape(product, [])


def _direct_words(t: tf.Tensor, word: int) -> tf.Tensor | None:
    """The words of ``t`` (of any shape) as one reshape and bitcast, when its values are
    words or whole fractions of words (same bytes as ``_as_words(_flat(t), word)``); None
    for booleans, complex numbers and words smaller than the values."""
    size = t.dtype.size
    if t.dtype == tf.bool or t.dtype.is_complex or word < size:
        return None
    if word == size:
        return tf.reshape(tf.bitcast(t, _INT_OF_SIZE[size]), [-1])
    return tf.bitcast(tf.reshape(t, [-1, word // size]), _INT_OF_SIZE[word])


def _known_bytes(t: tf.Tensor) -> int:
    """The bytes of one element times every dimension known when tracing: the byte count
    is a multiple of it whatever the unknown dimensions are (the element's bytes alone
    when even the rank is unknown)."""
    dims = t.shape.as_list() if t.shape.rank is not None else []
    return int(t.dtype.size) * math.prod(int(d) for d in dims if d is not None)


def _static_size(t: tf.Tensor) -> int | None:
    return t.shape.num_elements() if t.shape.is_fully_defined() else None


def _widen(words: tf.Tensor) -> tf.Tensor:
    return words if words.dtype == tf.int64 else tf.cast(words, tf.int64)


#: (word size in bytes, more than one chunk): how a tensor's content is computed, known
#: from its static shape (``static_plan``).
Plan = tuple[int, bool]


def static_plan(t: tf.Tensor) -> Plan | None:
    """The word size and chunking of ``t``'s content when its shape is known at trace time
    (None: decided from the size when the graph runs)."""
    if not t.shape.is_fully_defined():
        return None
    nbytes = t.shape.num_elements() * _element_bytes(t)  # bool: 1 byte; complex: both parts
    word = word_size(nbytes)
    return word, nbytes // word > CHUNK_WORDS


def _flat(t: tf.Tensor) -> tf.Tensor:
    """The tensor's bytes as same-size integers, flat (booleans as bytes; complex numbers
    as their real and imaginary parts, interleaved: the same bytes)."""
    if t.dtype == tf.bool:
        t = tf.cast(t, tf.uint8)
    elif t.dtype.is_complex:
        t = tf.stack([tf.math.real(t), tf.math.imag(t)], axis=-1)
    return tf.reshape(tf.bitcast(t, _INT_OF_SIZE[t.dtype.size]), [-1])


def _as_words(flat: tf.Tensor, word: int, reduce: Any) -> tf.Tensor:
    """``reduce`` of ``flat`` (``_flat``) grouped into words of ``word`` bytes."""
    size = flat.dtype.size
    if word == size:
        grouped = flat
    elif word > size:
        grouped = tf.bitcast(tf.reshape(flat, [-1, word // size]), _INT_OF_SIZE[word])
    else:  # bytes
        grouped = tf.reshape(tf.bitcast(flat, tf.uint8), [-1])
    return reduce(grouped)


def _words(t: tf.Tensor, reduce: Any) -> tf.Tensor:
    """``reduce`` applied to the tensor's bytes as narrow words (8, else 4, else 1 bytes:
    see the Note); uint8 words are zero-extended and int32 sign-extended when widened."""
    flat = _flat(t)
    size = flat.dtype.size

    def as_words(word: int) -> tf.Tensor:
        return _as_words(flat, word, reduce)

    if t.shape.is_fully_defined():  # the usual case: the word size is known when tracing
        return as_words(word_size(t.shape.num_elements() * t.dtype.size))
    # Dimensions known when tracing may settle the word size whatever the others are: a
    # batch of float32 images (None, 28, 28, 1) has a byte count that is a multiple of 8.
    # Each word size left open is a ``tf.cond`` branch, traced and instantiated.
    known = _known_bytes(t)
    if known % 8 == 0:
        return as_words(8)
    nbytes = tf.size(flat, out_type=tf.int64) * size
    choices = [w for w in (8, 4) if w >= size] + ([] if known % 4 == 0 else [1])
    result = functools.partial(as_words, choices[-1])
    for word in reversed(choices[:-1]):
        result = _choose(tf.equal(nbytes % word, 0), functools.partial(as_words, word), result)
    return result()


def _choose(condition: tf.Tensor, then: Any, otherwise: Any) -> Any:
    return lambda: tf.cond(condition, then, otherwise)
