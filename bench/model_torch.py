"""Reference PyTorch training script for the benchmark (a small CNN on synthetic images).

Prints the median step time so the benchmark can compare it with nondet's captured runs.
``--unseeded-noise`` adds noise from an unseeded NumPy generator at every step, so two runs
diverge at step 0 (the early-stop case). ``--narrow`` builds the narrow-activation variant
(16-32 channels, a step of about 25 ms here). ``--debug-mode norm|hash_tensor`` runs every
step under PyTorch's DebugMode logging that tensor hash of every op output (the peer the
benchmark compares op-level capture with) and prints the ops it logged per step.
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
parser.add_argument("--narrow", action="store_true")
parser.add_argument("--debug-mode", choices=["norm", "hash_tensor"])
args = parser.parse_args()

torch.manual_seed(0)
c1, c2 = (16, 32) if args.narrow else (64, 128)
model = nn.Sequential(
    nn.Conv2d(3, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(),
    nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(c2, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(c2 * 8 * 8, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10),
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
images = torch.randn(args.steps, args.batch, 3, 32, 32, generator=g)
labels = torch.randint(0, 10, (args.steps, args.batch), generator=g)
rng = np.random.default_rng() if args.unseeded_noise else None



def train_step(step: int) -> None:
    x = images[step]
    if rng is not None:
        x = x + torch.from_numpy(rng.normal(0, 0.01, x.shape).astype(np.float32))
    loss = nn.functional.cross_entropy(model(x), labels[step])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


times = []
logged = []  # ops DebugMode logged per step
for step in range(args.steps):
    start = time.perf_counter()
    if args.debug_mode:
        from torch.utils._debug_mode import DebugMode

        with DebugMode() as debug, DebugMode.log_tensor_hashes(args.debug_mode):
            train_step(step)
        logged.append(len(debug.operators))
    else:
        train_step(step)
    times.append(time.perf_counter() - start)
if logged:
    print(f"ops_per_step {statistics.median(logged)}")
print(f"median_step_ms {1000 * statistics.median(times[2:]):.3f}")
print(f"total_loop_s {sum(times):.3f}")
