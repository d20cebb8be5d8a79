"""A fingerprint being computed, and the host-side helpers both framework backends use."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np

from nondet.fingerprint import MASK64, bytes_fp, combine, host_words, word_size

_NP_WORDS = {8: np.int64, 4: np.int32, 1: np.uint8}


class Fp:
    """One tensor's fingerprint: its content sum (pending on the device, or already on the
    host) plus its description, combined into the final 64-bit ``value`` by ``finalize``.

    See Note [Derived fingerprints] (torch/cache.py): a fingerprint can instead be *derived*
    from other fingerprints (``parents``) and a description, without reading the tensor. ``lazy``
    fingerprints (uninitialized outputs, views of them) are computed only if read.
    """

    __slots__ = ("content", "meta", "parents", "uninit", "value")

    def __init__(self, value: int | None = None, uninit: bool = False) -> None:
        self.content: Any = None  # a device scalar still pending, or an int
        self.meta: tuple[int, ...] = ()
        self.parents: tuple[Fp, ...] | None = None
        self.value = value
        self.uninit = uninit

    @property
    def lazy(self) -> bool:
        return self.value is None and self.content is None and self.parents is None

    def finalize(self) -> None:
        """Combine the (host) content or the parents' values with the description."""
        if self.parents is not None:
            self.value = combine((*(p.value or 0 for p in self.parents), *self.meta))
            self.parents = None
        elif self.content is not None:
            self.value = combine((int(self.content) & MASK64, *self.meta))
        self.content = None


def narrow_host_words(values: np.ndarray) -> np.ndarray:
    """``host_words`` without widening to int64: a zero-copy view of a contiguous array in
    its word type (``host_content`` widens one chunk at a time, like the device paths)."""
    if not values.flags.c_contiguous:
        return host_words(values)
    raw = values.reshape(-1).view(np.uint8)
    return raw.view(_NP_WORDS[word_size(raw.size)])


def resolve(pending: list[Fp], read_back: Callable[[list[Any]], list[int]]) -> None:
    """Finalize ``pending`` in order (bases before what is derived from them), after bringing
    every content still on a device to the host with one ``read_back`` call (it gets those
    contents, returns their integers in the same order)."""
    waiting = [fp for fp in pending if fp.content is not None and not isinstance(fp.content, int)]
    if waiting:
        values = read_back([fp.content for fp in waiting])
        for fp, value in zip(waiting, values, strict=True):
            fp.content = value
    for fp in pending:
        fp.finalize()


def combined(fps: list[Fp]) -> int:
    """One value for a record's outputs or inputs: 0 when there are none, a lone
    fingerprint stands for itself (never 0, which means absent)."""
    if not fps:
        return 0
    if len(fps) == 1:
        return fps[0].value or 1
    return combine(fp.value or 0 for fp in fps)


def group_fp(values: list[int]) -> int:
    """One fingerprint for a group of fingerprints (0 when the group is empty)."""
    return combine(values) if values else 0


#: Host generators in the step rows' ``rng_fp``. A child process the script started turns
#: off what its start reseeded from entropy (``random`` at every fork, NumPy's too in a
#: spawned interpreter): as in plain runs, and a state nobody may draw from is no lead.
HOST_RNGS = {"numpy": True, "python": True}


def host_rng_fps() -> list[int]:
    """NumPy's legacy global RNG and Python's ``random``: seeded by nondet in every run."""
    fps = []
    if HOST_RNGS["numpy"]:
        fps.append(bytes_fp(np.random.get_state()[1].tobytes()))  # type: ignore[index]
    if HOST_RNGS["python"]:
        python_state = np.asarray(random.getstate()[1], dtype=np.uint64)
        fps.append(bytes_fp(python_state.tobytes()))
    return fps
