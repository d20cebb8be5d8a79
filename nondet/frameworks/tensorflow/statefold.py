"""Group contents of the step-level state with folded keys: a few ops per group, not a
dozen per variable.

A group's content (statehash.py) is  sum_k content_k * member_k,  and each member's
content is  sum_i chunk_i * sum_j w_ij * key_j  (Note [Fingerprint definition]): every
word of the group is multiplied by the product of its position key, its chunk's key and
its member's key, and everything is summed, modulo 2**64. Folding those products into one
key per word in advance (on the host, once per variable set) turns the group into one dot
product over its members' words: each variable is read and reshaped, same-type members are
concatenated (large variables are not copied: a dot product each), and one dot product
per piece gives the same number as hashing each
variable on its own. Hashing variable by variable made about 20 graph nodes per variable
(slicing the shared keys, sizes, casts), ~1,100 nodes on the narrow benchmark model, and
their dispatch, not the arithmetic, was most of the state hash's time.

A variable of at least ``_OWN_PIECE`` words and at most a chunk is not folded: its content
is its member key times the dot product of its words with the shared position keys
(``GraphHasher.keys``, the same number, since products distribute modulo 2**64). Every such
variable reads the same prefix of those keys, which stays in cache from one to the next,
where folded keys were as many more bytes read as the words themselves (on the narrow
benchmark model the state hash read 6.7 MB a step instead of 3.3, and kept 3.3 MB of keys).

The folded keys take as many bytes as the words they weigh, so they are made only when the
variables hashed this way hold at most ``FOLDED_WORDS`` words (32 MiB of keys); beyond
that the state is large, steps are long, and the per-variable path costs little in
comparison (``statehash.py`` falls back to it). Memory on the device: the keys, plus one
concatenated copy of the largest group while it is hashed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from nondet.fingerprint import CHUNK_WORDS, chunk_keys, position_keys, word_size
from nondet.frameworks.tensorflow.hashing import _as_words, _dot, _flat, _widen

#: Most words hashed through folded keys (their keys take 8 bytes a word).
FOLDED_WORDS = 1 << 22
#: Variables of at least this many words get a dot product of their own: concatenating
#: them copied the reference model's 15 MB of state each step and cost what the fewer
#: nodes saved; smaller ones are concatenated (their node count is what costs).
_OWN_PIECE = 1 << 14


def words_of(v: Any) -> int | None:
    """How many words a variable's content has (None: its shape is not fully known)."""
    if not v.shape.is_fully_defined():
        return None
    nbytes = int(v.shape.num_elements()) * int(v.dtype.size)
    return nbytes // word_size(nbytes)


def foldable(variables: Sequence[Any]) -> bool:
    """The variables' group contents can use folded keys: known shapes, one device, and
    no more than ``FOLDED_WORDS`` words in all."""
    sizes = [words_of(v) for v in variables]
    if any(n is None for n in sizes):
        return False
    return (len({getattr(v, "device", "") for v in variables}) <= 1
            and sum(n or 0 for n in sizes) <= FOLDED_WORDS)


def _member_keys(n: int, member: int) -> np.ndarray:
    """The folded keys of a member of ``n`` words: position key x chunk key (when the
    variable spans several chunks) x ``member`` (its key in the group), modulo 2**64."""
    if n <= CHUNK_WORDS:
        keys = position_keys(n)
    else:
        chunks = (n + CHUNK_WORDS - 1) // CHUNK_WORDS
        weights = chunk_keys(chunks)
        keys = np.concatenate([position_keys(min(CHUNK_WORDS, n - i * CHUNK_WORDS)) * weights[i]
                               for i in range(chunks)])
    with np.errstate(over="ignore"):  # int64 products wrap modulo 2**64, as the Note wants
        return keys * np.int64(member)


def _piece_kind(v: Any) -> str:
    """How a member's words are made: ``pairs`` (4-byte values in pairs: concatenated as
    they are, then read as int64), ``wide`` (8-byte values: read as int64), else
    ``other`` (through the general path, widened one variable at a time)."""
    n = v.shape.num_elements()
    if v.dtype.size == 4 and not v.dtype.is_complex and n % 2 == 0:
        return f"pairs:{v.dtype.name}"
    if v.dtype.size == 8 and not v.dtype.is_complex:
        return f"wide:{v.dtype.name}"
    return "other"


class FoldedGroup:
    """One group's content as a few dot products (module docstring). Made on the host for
    one variable set; ``content`` is called eagerly or while tracing, with the variables
    in the order they were given here."""

    def __init__(self, members: Sequence[Any], ready: Sequence[bool],
                 position_keys: Any = None) -> None:
        """``position_keys``: the shared keys of a chunk (``GraphHasher.keys``), for the
        large members to read instead of folded keys of their own (module docstring);
        None, or on another device than the members: every member folded."""
        weights = chunk_keys(len(members))
        self.device = getattr(members[0], "device", "") if members else ""
        shared = (position_keys is not None
                  and getattr(position_keys, "device", None) == self.device)
        self.position_keys = position_keys if shared else None
        by_kind: dict[str, list[int]] = {}
        own: set[str] = set()  # the pieces of one large member
        for k, v in enumerate(members):
            if ready[k] and v.shape.num_elements():  # not initialized: zeros, content 0
                kind = _piece_kind(v)
                if kind != "other" and (words_of(v) or 0) >= _OWN_PIECE:
                    kind = f"{kind}:{k}"  # large: a dot product of its own, not copied
                    own.add(kind)
                by_kind.setdefault(kind, []).append(k)
        self.pieces = sorted(by_kind.items())
        # word size of each member (the general path needs it; its shape is static)
        self.words = [word_size(v.shape.num_elements() * v.dtype.size) for v in members]
        # each piece's place in the folded keys, or its member key when it reads the shared
        # position keys (one large member of at most a chunk)
        self.bounds: list[tuple[int, int] | int] = []
        keys: list[np.ndarray] = []
        start = 0
        for kind, ks in self.pieces:
            size = sum(words_of(members[k]) or 0 for k in ks)
            if self.position_keys is not None and kind in own and size <= CHUNK_WORDS:
                self.bounds.append(int(weights[ks[0]]))
                continue
            keys.extend(_member_keys(words_of(members[k]) or 0, int(weights[k])) for k in ks)
            self.bounds.append((start, size))
            start += size
        host_keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
        # A variable, not a constant: a traced function copies small eager constants in
        # through the host, and reads a variable where it lives. Made by nondet: the
        # backend does not track it (``TFBackend.own_variables``).
        with tf.init_scope(), tf.device(self.device or None):
            self.keys = tf.Variable(host_keys, trainable=False, name="nondet_folded_keys")

    def content(self, values: Sequence[tf.Tensor]) -> tf.Tensor:
        """The group's content (int64 scalar) from its members' values (in the order the
        members were given; those not initialized are not read)."""
        keys = self.keys.value()
        shared = self.position_keys.value() if self.position_keys is not None else None
        total = tf.constant(0, tf.int64)
        for (kind, ks), bounds in zip(self.pieces, self.bounds, strict=True):
            if kind.startswith("pairs:"):
                flat = _concat([tf.reshape(values[k], [-1]) for k in ks])
                words = tf.bitcast(tf.reshape(flat, [-1, 2]), tf.int64)
            elif kind.startswith("wide:"):
                flat = _concat([tf.reshape(values[k], [-1]) for k in ks])
                words = tf.bitcast(flat, tf.int64)
            else:
                words = _concat([_as_words(_flat(values[k]), self.words[k], _widen)
                                 for k in ks])
            if isinstance(bounds, int):  # one member, weighed by the shared keys
                size = int(words.shape[0])
                content = _dot(words, tf.slice(shared, [0], [size]), self.device)
                total += content * tf.constant(bounds, tf.int64)
            else:
                start, size = bounds
                total += _dot(words, tf.slice(keys, [start], [size]), self.device)
        return total


def _concat(parts: list[tf.Tensor]) -> tf.Tensor:
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)
