"""Framework-independent parts of fingerprinting.

Note [Fingerprint definition]
A tensor's content fingerprint is  sum_i  w_i * K_i  (mod 2**64), where w_i are the
tensor's raw bytes read as 64-bit words (when the byte count is not a multiple of 8: as
signed 32-bit words, sign-extended, or else as unsigned 8-bit words, zero-extended) in
row-major order, and K_i are fixed odd 64-bit keys (splitmix64 of the position, with the
low bit set). Integer arithmetic wraps identically on
every device and in any reduction order, so the value is exact and reproducible on CPU and
GPU alike. A change in one word always changes the sum (K_i is odd, hence invertible mod
2**64); a permutation changes it unless two keys collide in their product, which happens
with negligible probability. An xor-reduction (``torch.hash_tensor``) would miss
permutations. Tensors longer than CHUNK_WORDS are hashed chunk by chunk and the chunk sums
are weighted by a second key sequence, so scratch memory stays bounded.

The device computes only that one 64-bit sum; shape, dtype and device are mixed in on the
host by ``describe``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import numpy as np

MASK64 = (1 << 64) - 1
#: The fingerprint definition's version, written into every capture's environment. A
#: baseline made under another definition is drift (its values are not comparable), so
#: `nondet check` asks for a new baseline instead of reporting every step as different.
#: Raise it whenever any backend's fingerprint of the same tensor changes. 3: a view read
#: after its base was written keeps its derived fingerprint (torch/cache.py, Note [Views
#: share their base's version]) instead of being hashed again. 4: TensorFlow graphs derive
#: ``Tile``, ``BroadcastTo`` and ``FloorMod`` outputs, and a variable read right after a
#: write to it (tensorflow/reads.py, Note [Reads after a write]), instead of hashing them.
#: 5: TensorFlow graphs derive ``MaxPool`` outputs from their input's;
#: TensorFlow step rows hold the data that entered (graph inputs made from host data,
#: a clean step's eager entries, the initial values of the variables a step made:
#: tensorflow/entries.py), so their ``data_fp`` is no longer 0; and
#: a call of torch.optim's Adam or SGD update kernel is one op record whose outputs
#: (parameters, gradients, optimizer state) are derived from the call's inputs at their
#: list index (torch/kernels.py, Note [Optimizer kernels as one record]), where each of
#: its ~9 pointwise ops per parameter was a record: op rows and the per-tensor fingerprints
#: of a step with op-level capture are not those of scheme 4.
#: 6: a torch step row's group fingerprints (parameters, buffers, gradients, optimizer
#: state) are the group's own in steps with op-level capture too (torch/stepstate.py
#: ``GroupFps``), where they combined the per-tensor fingerprints: a capture's step rows no
#: longer depend on which steps had op capture.
#: 7: a TensorFlow graph op reading a list a loop or branch made (``TensorListStack`` of
#: a ``tf.map_fn``) is named after that control-flow op, at its line
#: (tensorflow/traced.py, Note [Readers of a loop's lists]); TensorFlow's state hash folds
#: the variables in the order of their names, not of their creation
#: (tensorflow/backend.py, Note [Variables in the order of their names]).
#: 8: torch parameters no root module owns yet (the init row of an optimizer made before
#: the first forward; loose parameters) are folded by owner name and in the owner's order,
#: not in the order of the optimizers holding them, and are named after a variable, list,
#: tuple or dict holding them (torch/state.py ``_add_loose``, torch/owners.py);
#: TensorFlow string tensors are hashed (tensorflow/hashing.py, Note [Strings]): a step
#: row's data and op records of a model fed strings hold them.
SCHEME = "8"

CHUNK_WORDS = 1 << 20  # 8 MiB of int64 scratch per device
_CHUNK_KEY_OFFSET = 1 << 40  # chunk weights come from a disjoint part of the key stream


def splitmix64(index: np.ndarray) -> np.ndarray:
    """The splitmix64 output function of ``index`` (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        z = (index.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def position_keys(n: int, offset: int = 0) -> np.ndarray:
    """Odd 64-bit keys for positions offset..offset+n-1, as int64 (torch lacks uint64 mul)."""
    keys = splitmix64(np.arange(offset, offset + n, dtype=np.uint64)) | np.uint64(1)
    return keys.view(np.int64)


def chunk_keys(n: int) -> np.ndarray:
    return position_keys(n, _CHUNK_KEY_OFFSET)


_PACKERS: dict[int, struct.Struct] = {}  # by word count: formats parsed once
_blake2b = hashlib.blake2b


def combine(values: Iterable[int]) -> int:
    """Order-sensitive 64-bit combination of integers. Never returns 0 (0 means absent)."""
    return combine_packed(pack_words(values))


def pack_words(values: Iterable[int]) -> bytes:
    """The bytes ``combine`` hashes: each value modulo 2**64 as 8 little-endian bytes.
    ``combine(a + b) == combine_packed(pack_words(a) + pack_words(b))``, so a caller can
    pack a part that recurs (a description) once and reuse it."""
    words = [v & MASK64 for v in values]
    n = len(words)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = struct.Struct(f"<{n}Q")
        if n <= 256:
            _PACKERS[n] = packer
    return packer.pack(*words)


def combine_packed(data: bytes) -> int:
    """``combine`` of the values ``data`` packs (``pack_words``)."""
    return int.from_bytes(_blake2b(data, digest_size=8).digest(), "little") or 1


_NAME_CODES: dict[str, int] = {}


def name_code(name: str) -> int:
    """A stable 64-bit code for a string (dtype or device names): same on every machine."""
    code = _NAME_CODES.get(name)
    if code is None:
        code = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
        _NAME_CODES[name] = code
    return code


_DOUBLE = struct.Struct("<d")
#: scalar_value of floats by their bits (not by value: 0.0 == -0.0, nan != nan). Ops see the
#: same few scalars at every step (learning rate, betas, eps), so this stays small; capped.
_FLOAT_FPS: dict[bytes, int] = {}
#: scalar_value of Python ints (exactly ``int``: a bool is not one) by value; capped.
_INT_FPS: dict[int, int] = {}


def scalar_value(value: object) -> int:
    """Fingerprint of a Python number passed to an op (bit-exact for floats)."""
    if type(value) is float:
        bits = _DOUBLE.pack(value)
        fp = _FLOAT_FPS.get(bits)
        if fp is None:
            fp = combine((2, int.from_bytes(bits, "little")))
            if len(_FLOAT_FPS) < 4096:
                _FLOAT_FPS[bits] = fp
        return fp
    if type(value) is int:
        fp = _INT_FPS.get(value)
        if fp is None:
            fp = combine((1, value & MASK64, value >> 64))
            if len(_INT_FPS) < 4096:
                _INT_FPS[value] = fp
        return fp
    if isinstance(value, bool):
        return 0x5EED0000 + int(value)
    if isinstance(value, int):
        return combine((1, value & MASK64, value >> 64))
    if isinstance(value, float):
        return combine((2, struct.unpack("<Q", struct.pack("<d", value))[0]))
    if isinstance(value, complex):
        return combine((3, scalar_value(value.real), scalar_value(value.imag)))
    return combine((4, name_code(repr(value))))


def bytes_fp(data: bytes) -> int:
    """Fingerprint of an opaque byte string (RNG states, NumPy arrays on the host)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


def short(fp: int) -> str:
    """How fingerprints are shown to people: 12 hex digits are plenty to tell them apart."""
    return f"{fp & MASK64:016x}"[:12] if fp else "-"


# -- the host (NumPy) implementation, shared by every framework's CPU path ----------------
_NP_WORDS = {8: np.int64, 4: np.int32, 1: np.uint8}
_HOST_KEYS = np.zeros(0, dtype=np.int64)


def word_size(nbytes: int) -> int:
    """Words are 8 bytes when the byte count allows, else 4, else 1 (see the Note)."""
    return 8 if nbytes % 8 == 0 else 4 if nbytes % 4 == 0 else 1


def host_words(values: np.ndarray) -> np.ndarray:
    """The words of an array's raw bytes (row-major), as int64, per Note [Fingerprint
    definition]. Any dtype: only the bytes matter."""
    if not values.flags.c_contiguous:
        values = np.ascontiguousarray(values)
    raw = values.reshape(-1).view(np.uint8)
    word = word_size(raw.size)
    words = raw.view(_NP_WORDS[word])
    return words if word == 8 else words.astype(np.int64)


#: Word counts from which ``np.einsum`` computes the dot product instead of ``np.dot``:
#: on int64 its contiguous loop is vectorized (about 0.38 ns per word here against
#: 0.59 for ``np.dot``), below this its set-up costs more than it saves (~2 us). On int32
#: and uint8 words (float32, bfloat16 and odd-sized tensors) the gap is wider: ``np.dot``
#: of mixed types first casts the whole word array to int64 (a copy as large as the
#: tensor, written then read), ``np.einsum`` casts in small buffers that stay in cache
#: (Intel Xeon here, 1M int32 words: 0.71 ms against 1.13 ms; 262K: 0.17 against 0.28).
_EINSUM_FROM = 8192
#: Consecutive parts shorter than this many words are concatenated (widened to int64,
#: sign- or zero-extended as in the Note) and summed in one product: state groups hold
#: many small tensors (biases, Adam's step counters), each costing more in call overhead
#: than in arithmetic.
_SMALL_PART = 2048


def _dot(words: np.ndarray, keys: np.ndarray) -> int:
    """sum(words * keys) modulo 2**64 (as a Python int, not yet masked). Integer products
    and sums wrap modulo 2**64 in both NumPy kernels, in any order: the same number."""
    if words.size >= _EINSUM_FROM:
        return int(np.einsum("i,i->", words, keys))
    return int(np.dot(words, keys))


def _batched(parts: list[np.ndarray]) -> list[np.ndarray]:
    """``parts`` with each run of consecutive small parts concatenated into one array: the
    same words in the same order."""
    out: list[np.ndarray] = []
    run: list[np.ndarray] = []
    for words in parts:
        if words.size < _SMALL_PART:
            run.append(words)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else np.concatenate(run, dtype=np.int64))
            run = []
        out.append(words)
    if run:
        out.append(run[0] if len(run) == 1 else np.concatenate(run, dtype=np.int64))
    return out


def host_content(parts: list[np.ndarray]) -> int:
    """Content sum of the concatenated word arrays, chunked as in the Note (unsigned)."""
    global _HOST_KEYS
    if len(parts) == 1 and parts[0].size <= _HOST_KEYS.size:
        # One chunk with keys ready (most tensors): the loop below would do just this.
        words = parts[0]
        return _dot(words, _HOST_KEYS[: words.size]) & MASK64
    if len(parts) > 1:
        parts = _batched(parts)
    total = sum(p.size for p in parts)
    if _HOST_KEYS.size < min(total, CHUNK_WORDS):
        size = min(CHUNK_WORDS, max(total, 4096, 2 * _HOST_KEYS.size))
        _HOST_KEYS = position_keys(size)
    keys = _HOST_KEYS
    partial: list[int] = []
    acc, pos = 0, 0
    for words in parts:
        start, n = 0, words.size
        while start < n:
            take = min(n - start, CHUNK_WORDS - pos)
            # Integer dot products wrap modulo 2**64, like the device implementations.
            acc += _dot(words[start : start + take], keys[pos : pos + take])
            pos, start = pos + take, start + take
            if pos == CHUNK_WORDS:
                partial.append(acc & MASK64)
                acc, pos = 0, 0
    if pos or not partial:
        partial.append(acc & MASK64)
    if len(partial) == 1:
        return partial[0]
    weights = chunk_keys(len(partial))
    return sum(p * (int(w) & MASK64) for p, w in zip(partial, weights, strict=True)) & MASK64
