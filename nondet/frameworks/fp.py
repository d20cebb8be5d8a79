"""A fingerprint being computed: shared by the framework backends."""

from __future__ import annotations

from typing import Any

from nondet.fingerprint import MASK64, combine


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


def combined(fps: list[Fp]) -> int:
    """One value for a record's outputs or inputs: 0 when there are none, a lone
    fingerprint stands for itself (never 0, which means absent)."""
    if not fps:
        return 0
    if len(fps) == 1:
        return fps[0].value or 1
    return combine(fp.value or 0 for fp in fps)
