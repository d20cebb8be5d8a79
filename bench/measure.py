"""How bench/bench.py measures one configuration: a plain run of a benchmark script, a
captured run (no comparison), a whole ``nondet run``; the peak resident memory of a process
tree while it runs; what a capture costs on disk."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil


class PeakMemory:
    """Samples the resident memory of a process and all its descendants every 50 ms and
    keeps the largest total (nondet's parent and both runs are counted together)."""

    def __init__(self, pid: int) -> None:
        self.peak = 0
        self._root = psutil.Process(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.05):
            try:
                tree = [self._root, *self._root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for proc in tree:
                try:
                    total += proc.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._done.set()
        self._thread.join(timeout=5)
        return self.peak


def timed(command: list[str], allowed: tuple[int, ...] = (0,)) -> tuple[float, str, int]:
    """(wall seconds, stdout, peak resident bytes of the process tree) of one command."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    memory = PeakMemory(proc.pid)
    out, err = proc.communicate(timeout=3600)
    wall = time.perf_counter() - start
    peak = memory.stop()
    if proc.returncode not in allowed:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{err[-3000:]}")
    return wall, out, peak


def plain_run(model: Path, args: list[str]) -> tuple[float, float, int]:
    """(wall seconds, median step ms, peak resident bytes) of the script run directly."""
    wall, out, peak = timed([sys.executable, str(model), *args])
    return wall, median_ms(out), peak


def captured_run(model: Path, args: list[str], op_steps: list[int] | None,
                 out_dir: Path) -> tuple[float, Path]:
    """Median step ms of one run under nondet's capture (no comparison), and its capture."""
    from nondet.launch import CapturedRun, Plan, Target

    run = CapturedRun(Target(str(model), None, tuple(args)),
                      Plan("ops" if op_steps is None else "step", op_steps), 0, out_dir)
    run.start()
    result = run.wait(timeout=3600)
    if result.status != "complete":
        raise SystemExit(f"captured run failed: {result.log_tail()}")
    return median_ms(result.log_path.read_text()), result.path


def nondet_run(model: Path, args: list[str], out_dir: Path, *flags: str) -> tuple[float, int]:
    """(wall seconds, peak resident bytes of nondet and its runs) of a whole ``nondet run``."""
    wall, _, peak = timed([sys.executable, "-m", "nondet", "run", "-q", "--out", str(out_dir),
                           *flags, str(model), *args], allowed=(0, 1))
    return wall, peak


def op_record_bytes(capture: Path) -> tuple[int, float]:
    """Bytes of one op record in memory, and on disk after compression."""
    import h5py

    with h5py.File(capture, "r") as f:
        ops = f["ops"]
        return ops.dtype.itemsize, ops.id.get_storage_size() / max(1, ops.shape[0])


def capture_per_step(capture: Path) -> tuple[float, float]:
    """(file bytes per step, op records per op-captured step) of a capture."""
    import h5py

    with h5py.File(capture, "r") as f:
        steps = max(1, f["steps"].shape[0])
        op_steps = max(1, len({int(s) for s in f["op_index"]["step"]}))
        return capture.stat().st_size / steps, f["ops"].shape[0] / op_steps


def median_ms(output: str) -> float:
    return float(_field(output, "median_step_ms"))


def logged_ops(output: str) -> float:
    """Ops DebugMode logged per step (printed by the torch benchmark script)."""
    return float(_field(output, "ops_per_step"))


def _field(output: str, name: str) -> str:
    hit = re.search(rf"{name} ([0-9.]+)", output)
    if not hit:
        raise SystemExit(f"no {name} in the script's output:\n{output[-2000:]}")
    return hit.group(1)
