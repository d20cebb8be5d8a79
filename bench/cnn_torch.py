"""bench/model_torch.py's CNN, its Adam and eight fixed batches, for the in-process
benchmarks (torch_inprocess.py, torch_backend_inprocess.py)."""

from __future__ import annotations

import torch
from torch import nn


def reference_cnn(narrow: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor,
                                         torch.Tensor]:
    """(model, optimizer, images, labels): the reference model, or with ``narrow`` its
    16-32 channel variant; seeded, so every call builds the same."""
    torch.manual_seed(0)
    c1, c2 = (16, 32) if narrow else (64, 128)
    model = nn.Sequential(
        nn.Conv2d(3, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c2, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c2 * 8 * 8, 128), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(128, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(8, 32, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (8, 32), generator=g)
    return model, optimizer, images, labels
