"""The PyTorch backend: ``backend`` (steps, state, entries), ``ops`` (the dispatch-mode op
recorder) and ``hashing`` (tensor fingerprints on the tensor's device)."""

from __future__ import annotations

from nondet.frameworks.base import Session
from nondet.frameworks.torch.backend import TorchBackend


def create(session: Session) -> TorchBackend:
    return TorchBackend(session)
