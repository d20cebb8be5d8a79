"""A tiny deterministic training script with options to fail, crash, hang or print."""

import argparse
import os
import signal
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--fail-at", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
for step in range(args.steps):
    if step == args.fail_at:
        raise ValueError(f"boom at step {step}")
    if step == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(torch.ones(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} done", flush=True)
    time.sleep(args.sleep)
print("finished", args.steps)
