"""A stand-in for an augmentation library that keeps its own random generator, as
Albumentations 2.x does inside ``Compose``: made with no seed unless one is passed, so the
global seeds a script sets never reach it. Used by tests/data/scripts/library_rng.py; it
lives outside that script's directory, which is what makes it a library to nondet."""

from __future__ import annotations

import numpy as np


class Jitter:
    """Adds Gaussian noise drawn from the object's own generator."""

    def __init__(self, scale: float = 0.1, seed: int | None = None) -> None:
        self.scale = scale
        self.rng = np.random.default_rng(seed)  # seed None: fresh OS entropy in every run

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x + self.rng.normal(scale=self.scale, size=x.shape).astype(x.dtype)
