"""Trains on data augmented by a library object whose generator is unseeded (fakeaug.Jitter).

The script seeds torch, ``random`` and NumPy's global RNG; none of them reaches the generator
the library made for itself. ``--seeded`` passes the library's own seed parameter.
"""

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/data: fakeaug
from fakeaug import Jitter

ap = argparse.ArgumentParser()
ap.add_argument("--seeded", action="store_true")
args = ap.parse_args()
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
jitter = Jitter(scale=0.1, seed=0) if args.seeded else Jitter(scale=0.1)


class Noisy(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(jitter(np.full(8, float(i), dtype=np.float32)))


model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for batch in DataLoader(Noisy(), batch_size=8):
    loss = model(batch).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("weights", [round(float(p.detach().sum()), 8) for p in model.parameters()])
