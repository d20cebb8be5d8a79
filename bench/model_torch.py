"""Reference PyTorch training script for the benchmark (a small CNN on synthetic images).

Prints the median step time so the benchmark can compare it with nondet's captured runs.
``--unseeded-noise`` adds noise from an unseeded NumPy generator at every step, so two runs
diverge at step 0 (the early-stop case).
"""

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--unseeded-noise", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
    nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(128, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(128 * 8 * 8, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10),
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
images = torch.randn(args.steps, args.batch, 3, 32, 32, generator=g)
labels = torch.randint(0, 10, (args.steps, args.batch), generator=g)
rng = np.random.default_rng() if args.unseeded_noise else None

times = []
for step in range(args.steps):
    start = time.perf_counter()
    x = images[step]
    if rng is not None:
        x = x + torch.from_numpy(rng.normal(0, 0.01, x.shape).astype(np.float32))
    loss = nn.functional.cross_entropy(model(x), labels[step])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - start)
print(f"median_step_ms {1000 * statistics.median(times[2:]):.3f}")
print(f"total_loop_s {sum(times):.3f}")
