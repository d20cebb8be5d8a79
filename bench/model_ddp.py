"""The comm benchmark's model: a 2-rank DDP job on CPU (gloo), for bench/bench_comm.py.

An MLP (256 -> 1024 -> 1024 -> 10, about 1.3 M parameters, 5.4 MB of gradients: with a
``--bucket-cap-mb`` of 1, two DDP buckets a step, the 4 MB weight filling one), batch 64
of synthetic data per rank, SGD. Rank 0 prints ``median_step_ms X`` (the median wall time
of a step, the first two left out). Launch: ``torchrun --nproc-per-node 2
bench/model_ddp.py [--steps N] [--bucket-cap-mb MB]``.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 10)), bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1 + rank)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        x = torch.randn(64, 256, generator=gen)
        y = torch.randint(0, 10, (64,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"median_step_ms {1000 * statistics.median(times[2:]):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
