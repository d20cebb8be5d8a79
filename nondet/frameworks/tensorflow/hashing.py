"""TensorFlow fingerprints: Note [Fingerprint definition] as TF ops (inside graphs and on
accelerators) and through NumPy for eager CPU tensors. Both give the same number as the
torch implementations for the same bytes; tests check all of them against each other.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from nondet.fingerprint import (
    CHUNK_WORDS,
    chunk_keys,
    host_content,
    host_words,
    position_keys,
    word_size,
)

#: TF dtypes whose values can be fingerprinted (numbers and booleans).
HASHABLE = frozenset({
    tf.bool, tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32,
    tf.uint64, tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128,
})
_INT_OF_SIZE = {1: tf.uint8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def hashable(t: Any) -> bool:
    """A dense tensor of a dtype we can hash (sparse and ragged values are composites of
    dense tensors, hashed where their components are made)."""
    return isinstance(t, tf.Tensor) and t.dtype in HASHABLE


def host(t: Any) -> int:
    """Content sum of an eager tensor via NumPy (CPU)."""
    return host_content([host_words(np.asarray(t.numpy()))])


class GraphHasher:
    """Builds the in-graph fingerprint of a tensor: an int64 scalar computed on its device.

    Keys live in non-trainable variables created once (outside any graph), so graphs read
    them instead of embedding megabytes of constants.
    """

    def __init__(self) -> None:
        with tf.init_scope():
            self.keys = tf.Variable(position_keys(CHUNK_WORDS), trainable=False,
                                    name="nondet_keys")
            self.chunk_keys = tf.Variable(chunk_keys(4096), trainable=False,
                                          name="nondet_chunk_keys")

    def content(self, t: tf.Tensor) -> tf.Tensor:
        words = _words(t)
        n = tf.size(words, out_type=tf.int64)

        def one_chunk() -> tf.Tensor:
            return tf.reduce_sum(words * self.keys[:n])

        def chunked() -> tf.Tensor:
            chunks = (n + CHUNK_WORDS - 1) // CHUNK_WORDS
            padded = tf.pad(words, [[0, chunks * CHUNK_WORDS - n]])
            partial = tf.reduce_sum(tf.reshape(padded, [-1, CHUNK_WORDS]) * self.keys[None, :],
                                    axis=1)
            return tf.reduce_sum(partial * self.chunk_keys[:chunks])

        return tf.cond(n <= CHUNK_WORDS, one_chunk, chunked)


def _words(t: tf.Tensor) -> tf.Tensor:
    """The tensor's bytes as int64 words (8, else 4, else 1 bytes: see the Note)."""
    if t.dtype == tf.bool:
        t = tf.cast(t, tf.uint8)
    elif t.dtype.is_complex:  # real and imaginary parts, interleaved: the same bytes
        t = tf.stack([tf.math.real(t), tf.math.imag(t)], axis=-1)
    size = t.dtype.size
    flat = tf.reshape(tf.bitcast(t, _INT_OF_SIZE[size]), [-1])  # same-size integers

    def as_words(word: int) -> tf.Tensor:
        if word == size:
            grouped = flat
        elif word > size:
            grouped = tf.bitcast(tf.reshape(flat, [-1, word // size]), _INT_OF_SIZE[word])
        else:  # bytes
            grouped = tf.reshape(tf.bitcast(flat, tf.uint8), [-1])
        return tf.cast(grouped, tf.int64) if word != 8 else grouped

    if t.shape.is_fully_defined():  # the usual case: the word size is known when tracing
        return as_words(word_size(t.shape.num_elements() * size))
    nbytes = tf.size(flat, out_type=tf.int64) * size
    choices = [w for w in (8, 4) if w >= size] + [1]
    result = functools.partial(as_words, choices[-1])
    for word in reversed(choices[:-1]):
        result = _choose(tf.equal(nbytes % word, 0), functools.partial(as_words, word), result)
    return result()


def _choose(condition: tf.Tensor, then: Any, otherwise: Any) -> Any:
    return lambda: tf.cond(condition, then, otherwise)
