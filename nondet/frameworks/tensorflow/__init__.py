"""The TensorFlow/Keras backend: ``backend`` (steps, variables, Keras hooks, data), ``ops``
(the op callback and graph instrumentation) and ``hashing`` (in-graph and host fingerprints)."""

from __future__ import annotations

from nondet.frameworks.base import Session
from nondet.frameworks.tensorflow.backend import TFBackend


def create(session: Session) -> TFBackend:
    return TFBackend(session)
