"""How bench/bench.py measures one configuration: a plain run of a benchmark script, a
captured run (no comparison), a whole ``nondet run``; the peak resident memory of a process
tree while it runs; what a capture costs on disk."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

# Where bench.py writes its tables in docs/benchmarks.md.
MARKERS = ("<!-- bench:begin -->", "<!-- bench:end -->")


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


def publish(text: str, write: Path | None, begin: str, end: str) -> None:
    """Print the results, and put them between the markers of ``write`` if given."""
    print(text)
    if write:
        replace_section(write, text, begin, end)


def median_rounds(label: str, repeat: int,
                  one_round: Callable[[int], dict[str, float]]) -> dict[str, float]:
    """Each figure's median over ``repeat`` rounds of ``one_round(i)`` (progress and each
    round's figures on stderr)."""
    import statistics

    rounds = []
    for i in range(repeat):
        print(f"{label}: round {i + 1}/{repeat}", file=sys.stderr)
        rounds.append(one_round(i))
        print(rounds[-1], file=sys.stderr)
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def tree_cost(command: list[str], tree: Path, env: dict[str, str] | None = None
              ) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and every descendant it waited for) of
    ``command`` run from ``tree`` with that tree's nondet first on the path (``python -m``
    puts the working directory first on sys.path); ``env``: variables set for it."""
    import os
    import resource

    full_env = dict(os.environ, PYTHONPATH=str(tree), **(env or {}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env=full_env, cwd=tree, capture_output=True, text=True,
                          timeout=3600, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


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


def replace_section(path: Path, text: str, begin: str, end: str) -> None:
    """Put ``text`` between the markers ``begin`` and ``end`` of the Markdown file ``path``
    (appending the markers when the file has none), leaving the rest of the file as it was."""
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin not in old:
        old += f"\n{begin}\n{end}\n"
    head, rest = old.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}{end}{tail}")


def merge_tables(old: str, new: str) -> str:
    """The tables of ``old`` (Markdown, each from its ``### `` heading to the next) with
    those of ``new`` in place of the ones of the same heading, new headings appended: a run
    of one framework or model leaves the other tables as they were measured."""
    def tables(text: str) -> dict[str, str]:
        parts = [p for p in ("\n" + text).split("\n### ") if p.strip()]
        return {p.split("\n", 1)[0]: "### " + p.strip("\n") + "\n" for p in parts
                if not p.startswith("\n")}

    merged = tables(old)
    merged.update(tables(new))
    return "\n".join(merged.values())


def section(path: Path, begin: str, end: str) -> str:
    """The text between the markers of ``path`` ("" when the file or markers are missing)."""
    text = path.read_text() if path.exists() else ""
    if begin not in text or end not in text:
        return ""
    return text.split(begin, 1)[1].split(end, 1)[0]


def uptime() -> str:
    """The machine's load as `uptime` prints it: a benchmark on a shared machine says how
    busy it was, since the load moves every ratio."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    from nondet.environment import cpu_model as model

    return model()


def package_version(framework: str) -> str:
    from importlib.metadata import version

    return version("tensorflow-cpu" if framework == "tensorflow" else framework)


def measured_line(framework: str, setup: str, repeat: int, baseline: str,
                  load_before: str) -> str:
    """The line under a results table: when, on what, what was run, against what, and how
    loaded the machine was before and after (ratios on a shared machine move with load)."""
    import os
    import platform
    from datetime import UTC, datetime

    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Measured {when}, {platform.machine()}, {cpu_model()} ({os.cpu_count()} cores), "
            f"Python {platform.python_version()}, {framework} {package_version(framework)}; "
            f"{setup}; ratios are medians over {repeat} rounds, each against a {baseline} just "
            f"before it; `uptime` before: {load_before}; after: {uptime()}.\n")
