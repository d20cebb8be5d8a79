"""Many tiny steps: what ``nondet run`` costs on a script of thousands of sub-millisecond
steps (bench/model_tiny.py), as ratios against a plain run in the same invocation.

    python bench/bench_tiny.py [--steps N] [--repeat K] [--baseline-tree DIR]
                               [--write docs/benchmarks.md]

Each round runs, one after the other: a plain run, ``nondet run --no-verify`` in lockstep,
the same with ``--schedule sequential``, and (``--baseline-tree``) lockstep with the nondet
package found in DIR (another checkout: before/after in the same invocation). Each is
measured by its wall time and the CPU time of its whole process tree (nondet and both
runs); the result is the median over the rounds of each ratio to the round's plain run.
Runs use ``OMP_NUM_THREADS=1``: with torch's thread pool such tiny ops spend most of their
time waking it, and a plain run then moves with the machine's load alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from measure import measured_line, median_rounds, publish, tree_cost, uptime  # noqa: E402

MODEL = REPO / "bench" / "model_tiny.py"
BEGIN, END = "<!-- bench-tiny:begin -->", "<!-- bench-tiny:end -->"
THREADS = {"OMP_NUM_THREADS": "1"}  # see the module docstring


def one_round(steps: int, out: Path, baseline: Path | None) -> dict[str, float]:
    args = [str(MODEL), "--steps", str(steps)]
    nondet = [sys.executable, "-m", "nondet", "run", "-q", "--no-verify"]
    r: dict[str, float] = {}
    r["plain_wall"], r["plain_cpu"] = tree_cost([sys.executable, *args], REPO, THREADS)
    configs = {"lockstep": (REPO, []), "sequential": (REPO, ["--schedule", "sequential"])}
    if baseline is not None:
        configs["baseline"] = (baseline, [])
    for name, (tree, flags) in configs.items():
        wall, cpu = tree_cost([*nondet, "--out", str(out / name), *flags, *args], tree, THREADS)
        r[f"{name}_wall"], r[f"{name}_cpu"] = wall, cpu
        r[f"{name}_wall_x"] = wall / r["plain_wall"]
        r[f"{name}_cpu_x"] = cpu / r["plain_cpu"]
    return r


def summary(med: dict[str, float], baseline: Path | None) -> str:
    """The figures as one paragraph (docs/benchmarks.md embeds it in a list item)."""
    names = {"lockstep": "`nondet run --no-verify` in lockstep",
             "sequential": "with `--schedule sequential`",
             "baseline": f"lockstep with the nondet in `{baseline}`"}
    parts = [f"{label} {med[f'{key}_wall']:.1f} s ({med[f'{key}_wall_x']:.2f}x) wall, "
             f"{med[f'{key}_cpu']:.1f} s ({med[f'{key}_cpu_x']:.2f}x) CPU"
             for key, label in names.items() if f"{key}_wall" in med]
    return (f"Plain run {med['plain_wall']:.1f} s wall, {med['plain_cpu']:.1f} s CPU; "
            + "; ".join(parts) + " (CPU: the whole process tree, nondet and both runs).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path,
                        help="a directory holding another nondet package, measured alongside")
    parser.add_argument("--write", type=Path, help="update this Markdown file's tiny section")
    opts = parser.parse_args()
    load_before = uptime()
    with tempfile.TemporaryDirectory() as tmp:
        med = median_rounds("tiny steps", opts.repeat, lambda i: one_round(
            opts.steps, Path(tmp) / str(i), opts.baseline_tree))
    text = summary(med, opts.baseline_tree) + " " + measured_line(
        "torch", f"bench/model_tiny.py, {opts.steps} steps, OMP_NUM_THREADS=1", opts.repeat,
        "plain run", load_before)
    publish(text, opts.write, BEGIN, END)


if __name__ == "__main__":
    main()
