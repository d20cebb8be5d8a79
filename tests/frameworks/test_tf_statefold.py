"""Step-level state with folded keys (statefold.py) gives the same fingerprints as hashing
each variable on its own, and as the host, for every word size and across chunks; and its
graph stays a few ops per variable (issue 15: op dispatch was most of the state hash)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from nondet.fingerprint import CHUNK_WORDS, MASK64, chunk_keys, host_content  # noqa: E402
from nondet.frameworks.fp import narrow_host_words  # noqa: E402
from nondet.frameworks.tensorflow import statefold, statehash  # noqa: E402
from nondet.frameworks.tensorflow.hashing import GraphHasher  # noqa: E402
from nondet.frameworks.tensorflow.state import TrackedVariable  # noqa: E402
from nondet.records import Group  # noqa: E402

HASHER = GraphHasher()


def _tracked() -> list[tuple[TrackedVariable, Any]]:
    """Every word kind: 4-byte values in pairs (float32, int32), odd counts (4-byte words),
    8-byte values, bytes (bool, int8), a scalar, and a variable of two chunks."""
    gen = np.random.default_rng(7)
    values = [
        (Group.PARAM, gen.normal(size=(7, 6)).astype(np.float32)),
        (Group.PARAM, gen.normal(size=5).astype(np.float32)),  # odd: 4-byte words
        (Group.PARAM, gen.normal(size=(3, 3)).astype(np.float64)),
        (Group.BUFFER, np.arange(9, dtype=np.int32)),
        (Group.BUFFER, np.arange(10, dtype=np.int32)),
        (Group.BUFFER, gen.normal(size=3) > 0),  # bytes
        (Group.OPTIM, np.array(12, dtype=np.int64)),
        (Group.OPTIM, gen.integers(-9, 9, size=7).astype(np.int8)),
        # more than one chunk: 2 * CHUNK_WORDS + 4 float32 values are CHUNK_WORDS + 2 words
        (Group.OPTIM, gen.normal(size=2 * CHUNK_WORDS + 4).astype(np.float32)),
        (Group.OPTIM, gen.normal(size=(4, 2)).astype(np.float32)),
        # large enough for a dot product of their own, against the shared position keys
        (Group.PARAM, gen.normal(size=(200, 200)).astype(np.float32)),  # 20,000 words
        (Group.OPTIM, gen.normal(size=17_000)),  # float64: 17,000 words
    ]
    out = []
    for i, (group, value) in enumerate(values):
        v = tf.Variable(value, name=f"v{i}")
        out.append((TrackedVariable(weakref.ref(v), v.name, "", group), v))
    return out


def _host_group(vs: list[np.ndarray]) -> int:
    """A group's content on the host: each member's content weighted by its member key."""
    weights = chunk_keys(len(vs)).astype(np.uint64)
    total = 0
    for v, w in zip(vs, weights, strict=True):
        total += host_content([narrow_host_words(v)]) * int(w)
    return total & MASK64


def test_folded_groups_equal_the_per_variable_path_and_the_host() -> None:
    tracked = _tracked()
    assert statefold.foldable([v for _, v in tracked])
    folded = statehash.StateHasher(HASHER)
    once, traced = folded.state(tracked, False), folded.state(tracked, False)  # eager, traced
    per_variable = statehash.StateHasher(HASHER).state(tracked, True)  # detailed: one by one
    for state in (once, traced):
        assert (state.params, state.buffers, state.optim, state.params_sum.hex()) == (
            per_variable.params, per_variable.buffers, per_variable.optim,
            per_variable.params_sum.hex())
    for group, got in ((Group.PARAM, traced.params), (Group.BUFFER, traced.buffers),
                       (Group.OPTIM, traced.optim)):
        members = [v for t, v in tracked if t.group == group]
        content = _host_group([np.asarray(v.numpy()) for v in members])
        assert got == statehash._fp(content, tuple(
            m for v in members for m in statehash._meta(v)))
    tracked[8][1].assign_add(tf.ones_like(tracked[8][1]))  # the second chunk's words count
    assert folded.state(tracked, False).optim != traced.optim
    changed = folded.state(tracked, False)
    tracked[10][1].assign_add(tf.ones_like(tracked[10][1]))  # a member on the shared keys
    assert folded.state(tracked, False).params != changed.params


def test_large_members_read_the_shared_position_keys_not_folded_ones() -> None:
    """A member of one piece and at most a chunk keeps no folded keys of its own (they were
    as many bytes as its words); the two-chunk member and the small ones still do."""
    tracked = _tracked()
    members = [v for t, v in tracked if t.group == Group.OPTIM]
    group = statefold.FoldedGroup(members, [True] * len(members), HASHER.keys)
    words = {id(v): statefold.words_of(v) or 0 for v in members}
    shared = words[id(tracked[11][1])]
    assert shared == 17_000
    assert group.keys.shape[0] == sum(words.values()) - shared
    # without the shared keys (another device), every member is folded: the same content
    alone = statefold.FoldedGroup(members, [True] * len(members))
    assert alone.keys.shape[0] == sum(words.values())
    values = [v.value() for v in members]
    assert int(group.content(values)) == int(alone.content(values))


def test_the_state_graph_has_a_few_ops_per_variable() -> None:
    """Hashed one by one, a variable took about 20 graph nodes (sizes, key slices, casts);
    folded, a read and a reshape, plus a few per group and per parameter's float sum."""
    gen = np.random.default_rng(3)
    tracked = []
    for i in range(40):
        v = tf.Variable(gen.normal(size=(16, 8)).astype(np.float32), name=f"w{i}")
        tracked.append((TrackedVariable(weakref.ref(v), v.name, "",
                                        Group.PARAM if i < 10 else Group.OPTIM), v))
    hasher = statehash.StateHasher(HASHER)
    hasher.state(tracked, False)
    hasher.state(tracked, False)
    (function,) = hasher._functions.values()
    nodes = len(function.graph.as_graph_def().node)  # type: ignore[union-attr]
    assert nodes <= 40 * 6 + 60, nodes


def test_too_many_words_keep_the_per_variable_path(monkeypatch: pytest.MonkeyPatch) -> None:
    tracked = _tracked()[:4]
    monkeypatch.setattr(statefold, "FOLDED_WORDS", 10)
    assert not statefold.foldable([v for _, v in tracked])
    small = statehash.StateHasher(HASHER).state(tracked, False)
    monkeypatch.undo()
    assert statefold.foldable([v for _, v in tracked])
    assert small.params == statehash.StateHasher(HASHER).state(tracked, False).params
