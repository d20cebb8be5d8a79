"""The PyTorch backend: ``backend`` (steps, state, entries), ``ops`` (the dispatch-mode op
recorder) and ``hashing`` (tensor fingerprints on the tensor's device)."""

from __future__ import annotations

from nondet.frameworks.base import Backend, Session


def create(session: Session) -> Backend:
    # imported here: the package's own modules import each other, never this file
    from nondet.frameworks.torch.backend import TorchBackend

    return TorchBackend(session)
