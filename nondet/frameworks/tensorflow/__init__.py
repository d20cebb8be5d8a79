"""The TensorFlow/Keras backend: ``backend`` (steps, variables, Keras hooks, data), ``ops``
(the op callback and graph instrumentation) and ``hashing`` (in-graph and host fingerprints)."""

from __future__ import annotations

from nondet.frameworks.base import Backend, Session


def create(session: Session) -> Backend:
    # imported here: the package's own modules import each other, never this file
    from nondet.frameworks.tensorflow.backend import TFBackend

    return TFBackend(session)
