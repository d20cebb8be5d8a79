"""Many tiny steps: a 3-layer MLP on 64x8 inputs trained with SGD, a step of well under a
millisecond (``OMP_NUM_THREADS=1``). Real small models look like this (MNIST MLPs, tabular
nets, RL loops): nondet's cost there is per step, not per op (bench/bench_tiny.py).

Prints the median step time and the loop's total, as bench/model_torch.py.
``--unseeded-noise`` adds noise from an unseeded NumPy generator at ``--noise-step`` (so the
runs part there: the diverging case, judged while both run).
"""

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2000)
parser.add_argument("--unseeded-noise", action="store_true")
parser.add_argument("--noise-step", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                      nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
inputs = torch.randn(64, 8, generator=g)
targets = torch.randn(64, 1, generator=g)
rng = np.random.default_rng() if args.unseeded_noise else None

times = []
for step in range(args.steps):
    start = time.perf_counter()
    x = inputs
    if rng is not None and step == args.noise_step:
        x = x + torch.from_numpy(rng.normal(0, 0.01, x.shape).astype(np.float32))
    loss = nn.functional.mse_loss(model(x), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - start)
print(f"median_step_ms {1000 * statistics.median(times[2:]):.3f}")
print(f"total_loop_s {sum(times):.3f}")
