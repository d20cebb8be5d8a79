"""The whole torch backend's cost inside one process: hooks, step ends and op capture.

    python bench/torch_backend_inprocess.py step|ops [--reference] [--rounds N]
                                            [--block K] [--threads N] [--parts] [--count]
                                            [--profile]

``bench/torch_inprocess.py`` drives the op recorder alone; this runs the real
``TorchBackend`` on a real ``Session`` (its frames written to a pipe that a thread drains):
module, backward and optimizer hooks, the step ends (state fingerprints, the step row
sent) and, with ``ops``, the dispatch mode at every step. Blocks of ``--block`` plain
steps (the backend's hooks taken out of torch's hook tables and the backend paused) and
captured steps alternate; the first step of each block is left out (a captured step after
plain ones reads state the recorder did not see written). Median main-thread CPU time per
step of each, and median wall time, torch on ``--threads`` threads (1: the ratios do not
move with other processes' load as wall time does; but the plain step is then about twice
as long as on the 2 threads ``bench/bench.py`` runs, while nondet's step-end work, NumPy on
one thread, stays the same, so the 1-thread ratio is the lower one). ``--parts``: thread
CPU per step inside each hook; ``--count``: op records per step by phase and name;
``--profile``: cProfile of the captured steps (``SORT``, ``TOP``: its order and length).
Not measured: the parent process (storing the rows), which a real captured run has on another core.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from cnn_torch import reference_cnn
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils._python_dispatch import _disable_current_modes

from nondet import session as session_module
from nondet.records import Phase
from nondet.session import ChildConfig, Session

#: torch's global hook tables the backend registers in (emptied for plain steps)
HOOK_TABLES = [(nn_module, "_global_forward_pre_hooks"), (nn_module, "_global_forward_hooks"),
               (nn_module, "_global_forward_hooks_always_called"),
               (optim_module, "_global_optimizer_pre_hooks"),
               (optim_module, "_global_optimizer_post_hooks")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["step", "ops"])
    parser.add_argument("--reference", action="store_true", help="the reference model")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", action="store_true")
    parser.add_argument("--count", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the captured steps: the top functions by own time")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)

    channel_r, channel_w = os.pipe()
    control_r, _control_w = os.pipe()  # never written: no STOP

    def drain() -> None:
        while os.read(channel_r, 1 << 20):
            pass

    threading.Thread(target=drain, daemon=True).start()
    session = Session(ChildConfig(label="a", seed=0, channel_fd=channel_w,
                                  control_fd=control_r,
                                  op_steps=None if opts.mode == "ops" else []))
    session_module._CURRENT = session
    from nondet.frameworks.torch import create

    backend: Any = create(session)
    session.backends.append(backend)

    model, optimizer, images, labels = reference_cnn(not opts.reference)

    def step(i: int) -> None:
        loss = nn.functional.cross_entropy(model(images[i % 8]), labels[i % 8])
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    step(0)
    step(1)  # the draw watch's hook gone, the optimizer's state made
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def timed(f: Callable[..., Any], label: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent[label] += time.thread_time() - c0
                calls[label] += 1
        return run

    if opts.parts:
        for module, name in HOOK_TABLES:
            table = getattr(module, name)
            if not name.endswith("always_called"):
                for key in list(table):
                    table[key] = timed(table[key], name.strip("_"))
        for name in ("_before_backward", "_after_backward", "_grad_snapshot", "_step_state",
                     "_take_records"):
            setattr(backend, name, timed(getattr(backend, name), name))
        session.end_step = timed(session.end_step, "session.end_step")  # type: ignore[method-assign]
    records: collections.Counter[tuple[str, str]] = collections.Counter()
    if opts.count:
        end_step = session.end_step

        def counting(row: Any, tensors: Any, ops: Any) -> None:
            records[("", "")] += 1  # the steps
            for r in ops:
                records[(Phase(int(r["phase"])).name, session.string(int(r["name"])))] += 1
            end_step(row, tensors, ops)

        session.end_step = counting  # type: ignore[method-assign]
    tables = {(module, name): dict(getattr(module, name)) for module, name in HOOK_TABLES}

    def plain(i: int) -> None:
        for (module, name) in tables:
            getattr(module, name).clear()
        backend.paused, backend.recorder.active = True, False
        try:
            with _disable_current_modes():
                step(i)
        finally:
            backend.paused, backend.recorder.active = False, True
            for (module, name), saved in tables.items():
                getattr(module, name).update(saved)

    import cProfile
    import pstats

    profiler = cProfile.Profile() if opts.profile else None
    cpu: dict[str, list[float]] = {"plain": [], "captured": []}
    wall: dict[str, list[float]] = {"plain": [], "captured": []}
    captured_steps = 0
    spent.clear()
    calls.clear()
    for i in range(opts.rounds + 1):
        for kind in ("plain", "captured") if i % 2 else ("captured", "plain"):
            for j in range(opts.block):
                profiling = profiler is not None and kind == "captured" and i >= 1
                if profiling:
                    profiler.enable()  # type: ignore[union-attr]
                c0, w0 = time.thread_time(), time.perf_counter()
                (plain if kind == "plain" else step)(i * opts.block + j)
                if profiling:
                    profiler.disable()  # type: ignore[union-attr]
                if i >= 1 and j >= 1:
                    cpu[kind].append(time.thread_time() - c0)
                    wall[kind].append(time.perf_counter() - w0)
                captured_steps += kind == "captured"
    base, captured = statistics.median(cpu["plain"]), statistics.median(cpu["captured"])
    wall_base = statistics.median(wall["plain"])
    wall_captured = statistics.median(wall["captured"])
    print(f"{'reference' if opts.reference else 'narrow'} model, {opts.mode}, "
          f"{opts.threads} thread(s), {opts.rounds} rounds of {opts.block}: plain "
          f"{1e3 * base:.2f} ms, captured {1e3 * captured:.2f} ms cpu "
          f"({captured / base:.3f}x, +{1e3 * (captured - base):.2f} ms); wall plain "
          f"{1e3 * wall_base:.2f} ms, captured {1e3 * wall_captured:.2f} ms "
          f"({wall_captured / wall_base:.3f}x)")
    for label in sorted(spent, key=lambda k: -spent[k]):
        print(f"  {label:32s} {1e6 * spent[label] / captured_steps:7.0f} us per step "
              f"({calls[label] / captured_steps:.1f} calls)")
    if profiler is not None:
        order, top = os.environ.get("SORT", "tottime"), int(os.environ.get("TOP", "30"))
        pstats.Stats(profiler).sort_stats(order).print_stats(top)
    if records:
        steps = records.pop(("", ""))
        by_phase: collections.Counter[str] = collections.Counter()
        for (phase, _), n in records.items():
            by_phase[phase] += n
        print("  op records per step: " + ", ".join(
            f"{phase} {n / steps:.1f}" for phase, n in by_phase.most_common()))
        for (phase, name), n in records.most_common(12):
            print(f"    {n / steps:6.1f} {phase:9s} {name}")


if __name__ == "__main__":
    main()
