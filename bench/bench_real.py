"""Real training scripts: what a whole ``nondet run`` costs against one plain run of the
same script, in the same invocation.

    python bench/bench_real.py [--repeat K] [--baseline-tree DIR] [--write docs/benchmarks.md]

The scripts are stand-ins for what users run, not benchmark models built for the purpose:
keras-io's MNIST convnet (``model.fit`` with a validation split: two traced functions and
data of unknown batch length, bench/model_keras_mnist.py) and the nanoGPT training loop of
the real-library fixtures (fixtures/real/nanogpt_loop.py: autocast, accumulation,
clipping). Each round runs a plain run, then ``nondet run -q`` (the default schedule; the
scripts are deterministic, so no fix is verified), and with ``--baseline-tree`` the same
with the nondet package found in DIR (another checkout: before/after in one invocation).
Each is measured by its wall time and the CPU time of its whole process tree; the result
is the median over the rounds of each ratio to the round's plain run. The target for a
deterministic script is <= 2.2x one plain run (DESIGN.md section 9).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from measure import (  # noqa: E402
    measured_line,
    median_rounds,
    package_version,
    publish,
    tree_cost,
    uptime,
)

BEGIN, END = "<!-- bench-real:begin -->", "<!-- bench-real:end -->"
#: name -> (framework, script and arguments)
SCRIPTS = {
    "keras-io MNIST convnet (`model.fit`, 86 steps)":
        ("tensorflow", [str(REPO / "bench" / "model_keras_mnist.py")]),
    "nanoGPT loop (torch, 40 iterations)":
        ("torch", [str(REPO / "fixtures" / "real" / "nanogpt_loop.py"), "--iters", "40"]),
}


def one_round(script: list[str], out: Path, baseline: Path | None) -> dict[str, float]:
    r: dict[str, float] = {}
    r["plain_wall"], r["plain_cpu"] = tree_cost([sys.executable, *script], REPO)
    trees = {"nondet": REPO} | ({"baseline": baseline} if baseline is not None else {})
    for name, tree in trees.items():
        wall, cpu = tree_cost([sys.executable, "-m", "nondet", "run", "-q", "--out",
                               str(out / name), *script], tree)
        r[f"{name}_wall"], r[f"{name}_cpu"] = wall, cpu
        r[f"{name}_wall_x"], r[f"{name}_cpu_x"] = wall / r["plain_wall"], cpu / r["plain_cpu"]
    return r


def row(name: str, med: dict[str, float], baseline: Path | None) -> str:
    cells = [name, f"{med['plain_wall']:.1f} s", f"{med['nondet_wall']:.1f} s",
             f"{med['nondet_wall_x']:.2f}x", f"{med['nondet_cpu_x']:.2f}x"]
    if baseline is not None:
        cells += [f"{med['baseline_wall_x']:.2f}x", f"{med['baseline_cpu_x']:.2f}x"]
    cells.append("yes" if med["nondet_wall_x"] <= 2.2 else "no")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path,
                        help="a directory holding another nondet package, measured alongside")
    parser.add_argument("--write", type=Path, help="update this Markdown file's section")
    opts = parser.parse_args()
    load_before = uptime()
    header = ["script", "plain run", "`nondet run`", "wall", "CPU"]
    if opts.baseline_tree is not None:
        header += [f"wall, nondet in `{opts.baseline_tree}`", "CPU, same"]
    header.append("<= 2.2x")
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    frameworks = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (framework, script) in SCRIPTS.items():
            folder = Path(tmp) / str(len(lines))

            def measured(i: int, script: list[str] = script, folder: Path = folder
                         ) -> dict[str, float]:
                return one_round(script, folder / str(i), opts.baseline_tree)

            med = median_rounds(name, opts.repeat, measured)
            lines.append(row(name, med, opts.baseline_tree))
            frameworks.append(framework)
    others = sorted(set(frameworks) - {"torch"})  # measured_line names torch's version
    setup = ", ".join([*(f"{f} {package_version(f)}" for f in others),
                       "bench/bench_real.py, `nondet run -q` of each script"])
    text = "\n".join(lines) + "\n\n" + measured_line("torch", setup, opts.repeat,
                                                      "plain run", load_before)
    publish(text, opts.write, BEGIN, END)


if __name__ == "__main__":
    main()
