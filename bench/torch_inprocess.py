"""Op-level capture's cost inside one process, where a shared machine's load cancels out.

    python bench/torch_inprocess.py [--narrow] [--rounds N] [--threads N] [--step-level]
                                    [--detailed]

Runs the benchmark model's training step (bench/model_torch.py's model, optimizer and
data) in one process, round-robin: plainly; under a dispatch mode that only passes ops
through (what any Python ``TorchDispatchMode`` costs); under nondet's op recorder with
hashing replaced by a constant (the bookkeeping: cache, records, derived fingerprints);
and under the recorder as it runs in a capture. Each configuration's median thread CPU
time and wall time per step are printed, with ratios to the plain step. CPU time of the
main thread is what the recorder adds (it is single-threaded Python); with ``--threads 1``
(the default) torch's kernels run in that thread too, so the ratios do not move with
other processes' load. Step boundaries (step-level state) are not included: the recorder
is driven directly through the stand-in backend the tests use
(nondet/frameworks/torch/testing.py).

``--step-level`` measures step-level capture instead: the plain step, and the plain step
followed by what the backend does at each step end of a step-level capture (named state,
the gradients' group fingerprint at the optimizer step, then ``StateFingerprints.step_state``:
the state groups' fingerprints, RNG state, the float64 parameter sum and the loss read back;
not the step row's transport to the parent process, which is session.py's).
``--detailed`` makes that the step end of a step with op-level capture: a fingerprint and
float statistics (sum, max |x|) per tensor instead of one fingerprint per group (here every
tensor is hashed, as no recorded op has cached its fingerprint).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from cnn_torch import reference_cnn
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nondet.frameworks.torch.state import named_state
from nondet.frameworks.torch.stepstate import StateFingerprints
from nondet.frameworks.torch.testing import RecordMode
from nondet.frameworks.torch.testing import recorder as fake_recorder


class _Pass(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--narrow", action="store_true")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step-level", action="store_true",
                        help="measure step-level capture (state fingerprints at step ends)")
    parser.add_argument("--detailed", action="store_true",
                        help="with --step-level: the step end of a step with op capture")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    model, optimizer, images, labels = reference_cnn(opts.narrow)

    def step(i: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(images[i % 8]), labels[i % 8])
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return loss

    recorder = fake_recorder()
    content = recorder.hasher.content
    records: dict[str, int] = {}
    state = StateFingerprints(recorder, recorder.hasher)
    names = {id(x): n for n, x in [*model.named_parameters(), *model.named_buffers()]}
    optimizers: list[weakref.ref[torch.optim.Optimizer]] = [weakref.ref(optimizer)]

    state_cpu: list[float] = []  # thread CPU time of the step-level work alone
    state_wall: list[float] = []  # and its wall time

    def step_level(i: int) -> None:
        loss = step(i)
        # as TorchBackend does: gradients at the optimizer step, the rest at the step end
        c0, w0 = time.thread_time(), time.perf_counter()
        with torch.no_grad():
            params, _, _ = named_state([model], optimizers, names)
            grads = state.named([(n, p.grad) for n, p in params if p.grad is not None],
                                detailed=opts.detailed)
            params, buffers, optim = named_state([model], optimizers, names)
            scalar = loss.detach().real.reshape(()).to(torch.float64)
            state.step_state(params, buffers, optim, grads, scalar, detailed=opts.detailed)
        state_cpu.append(time.thread_time() - c0)
        state_wall.append(time.perf_counter() - w0)

    def run(kind: str, i: int) -> None:
        if kind == "plain":
            step(i)
            return
        if kind == "step-level capture":
            step_level(i)
            return
        if kind == "pass-through mode":
            with _Pass():  # type: ignore[no-untyped-call]
                step(i)
            return
        recorder.hasher.content = (  # type: ignore[method-assign]
            (lambda t, **_: 0) if kind == "recorder, no hashing" else content)
        recorder.open_window()  # as at each captured step: the cache starts empty
        with RecordMode(recorder):
            step(i)
        recorder.resolve()
        records[kind] = len(recorder.take_rows(0))
        recorder.prune()

    kinds = (["plain", "step-level capture"] if opts.step_level else
             ["plain", "pass-through mode", "recorder, no hashing", "recorder"])
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(opts.rounds + 2):
        for kind in kinds:
            c0, w0 = time.thread_time(), time.perf_counter()
            run(kind, i)
            if i >= 2:  # warm-up rounds left out
                cpu[kind].append(time.thread_time() - c0)
                wall[kind].append(time.perf_counter() - w0)
    base_cpu, base_wall = (statistics.median(cpu["plain"]), statistics.median(wall["plain"]))
    print(f"{'narrow' if opts.narrow else 'reference'} model, {opts.threads} thread(s), "
          f"{opts.rounds} rounds; op records per step: {records.get('recorder', 0)}")
    for kind in kinds:
        c, w = statistics.median(cpu[kind]), statistics.median(wall[kind])
        print(f"  {kind:22s} cpu {1000 * c:7.2f} ms ({c / base_cpu:.2f}x)  "
              f"wall {1000 * w:7.2f} ms ({w / base_wall:.2f}x)")
    if opts.step_level:
        extra = statistics.median(state_cpu[2:])
        wall_extra = statistics.median(state_wall[2:])
        print(f"  step-level work alone per step (cpu): {1e6 * extra:.0f} us "
              f"({1 + extra / base_cpu:.3f}x of the plain step's cpu), wall "
              f"{1e6 * wall_extra:.0f} us ({1 + wall_extra / base_wall:.3f}x)")
        return
    per_op = (statistics.median(cpu["recorder"]) - base_cpu) / max(1, records["recorder"])
    print(f"  recorder cost per op record (cpu): {1e6 * per_op:.1f} us")


if __name__ == "__main__":
    main()
