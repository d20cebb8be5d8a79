"""nondet's benchmark: overheads as ratios against a plain run in the same invocation.

    python bench/bench.py [--framework torch|tensorflow] [--steps N] [--repeat K]
                          [--write docs/benchmarks.md]

Measures, for each framework on its reference CPU model (bench/model_torch.py and
bench/model_tf.py: the same small CNN with batch norm, dropout and Adam):

- step-level capture: median step time captured / plain (target <= 1.05)
- op-level capture of every op: median step time captured / plain (target <= 1.5 torch,
  <= 2 TensorFlow)
- ``nondet run`` on the deterministic script: wall time / one plain run (target <= 2.2)
- ``nondet run`` on a variant that diverges at step 0: wall time / one plain run of that
  variant (target <= 1.3)
- bytes per op record: in memory and on disk after compression (target <= 64)

Each round runs every configuration right after a plain run and takes the ratio of the
two; the result is the median over ``--repeat`` rounds (on a noisy shared machine the
ratio of neighbours is steadier than either time). Timings are never asserted in tests;
this script reports them.
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {"torch": REPO / "bench" / "model_torch.py",
          "tensorflow": REPO / "bench" / "model_tf.py"}
sys.path.insert(0, str(REPO))

TARGETS = {"step": 1.05, "run_det": 2.2, "run_div": 1.3, "bytes": 64}
OPS_TARGET = {"torch": 1.5, "tensorflow": 2.0}  # DESIGN.md section 9


def plain_run(model: Path, args: list[str]) -> tuple[float, float]:
    """(wall seconds, median step ms) of the script run directly with Python."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(model), *args], capture_output=True, text=True,
                         check=True).stdout
    return time.perf_counter() - start, _median_ms(out)


def captured_run(model: Path, args: list[str], op_steps: list[int] | None,
                 out_dir: Path) -> tuple[float, Path]:
    """Median step ms of one run under nondet's capture (no comparison), and its capture."""
    from nondet.launch import CapturedRun, Plan, Target

    run = CapturedRun(Target(str(model), None, tuple(args)),
                      Plan("ops" if op_steps is None else "step", op_steps), 0, out_dir)
    run.start()
    result = run.wait()
    if result.status != "complete":
        raise SystemExit(f"captured run failed: {result.log_tail()}")
    return _median_ms(result.log_path.read_text()), result.path


def nondet_run(model: Path, args: list[str], out_dir: Path, *flags: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nondet", "run", "-q", "--out", str(out_dir),
                           *flags, str(model), *args], capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"nondet run failed: {proc.stderr}")
    return time.perf_counter() - start


def op_record_bytes(capture: Path) -> tuple[int, float]:
    import h5py

    with h5py.File(capture, "r") as f:
        ops = f["ops"]
        return ops.dtype.itemsize, ops.id.get_storage_size() / max(1, ops.shape[0])


def _median_ms(output: str) -> float:
    hit = re.search(r"median_step_ms ([0-9.]+)", output)
    if not hit:
        raise SystemExit(f"no median_step_ms in the script's output:\n{output[-2000:]}")
    return float(hit.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted(MODELS), action="append",
                        help="benchmark only this framework (repeatable; default: both)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--write", type=Path, help="update this Markdown file's results table")
    opts = parser.parse_args()
    texts = [bench(framework, opts.steps, opts.repeat)
             for framework in (opts.framework or ["torch", "tensorflow"])]
    text = "\n".join(texts)
    print(text)
    if opts.write:
        _update(opts.write, text)


def bench(framework: str, steps: int, repeat: int) -> str:
    """One framework's results table, as Markdown."""
    model = MODELS[framework]
    args = ["--steps", str(steps)]
    noisy = [*args, "--unseeded-noise"]
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for i in range(repeat):
            print(f"{framework}: round {i + 1}/{repeat}", file=sys.stderr)
            # Each configuration right after its own plain run: neighbours in time share
            # the machine's mood, so the ratio of the two is steadier than either time.
            wall, step_ms = plain_run(model, args)
            step_level, _ = captured_run(model, args, [], out / "step")
            _, step_ms2 = plain_run(model, args)
            op_level, capture = captured_run(model, args, None, out / "ops")
            wall2, _ = plain_run(model, args)
            det = nondet_run(model, args, out / "det")
            wall_noisy, _ = plain_run(model, noisy)
            # Diagnosis alone (as before fixes were verified), then with verification on.
            div = nondet_run(model, noisy, out / "div", "--no-verify")
            wall_noisy2, _ = plain_run(model, noisy)
            verified = nondet_run(model, noisy, out / "verify")
            rounds.append({"step": step_level / step_ms, "ops": op_level / step_ms2,
                           "run_det": det / wall2, "run_div": div / wall_noisy,
                           "run_verify": verified / wall_noisy2,
                           "plain_step": step_ms, "plain_wall": wall})
        record, on_disk = op_record_bytes(capture)
    results = {key: statistics.median(r[key] for r in rounds)
               for key in ("step", "ops", "run_det", "run_div", "run_verify")}
    best = {"plain_step": min(r["plain_step"] for r in rounds),
            "plain_wall": min(r["plain_wall"] for r in rounds)}
    rows = [
        ("step-level capture, step time", results["step"], TARGETS["step"], "x"),
        ("op-level capture (every op), step time", results["ops"], OPS_TARGET[framework], "x"),
        ("`nondet run`, deterministic script, wall", results["run_det"], TARGETS["run_det"], "x"),
        ("`nondet run --no-verify`, diverges at step 0, wall", results["run_div"],
         TARGETS["run_div"], "x"),
        ("`nondet run` (fixes verified), diverges at step 0, wall", results["run_verify"],
         None, "x"),
        ("op record, in memory (bytes)", record, TARGETS["bytes"], ""),
        ("op record, on disk after compression (bytes)", on_disk, TARGETS["bytes"], ""),
    ]
    table = [f"### {framework} ({model.relative_to(REPO)})", "",
             "| measure | result | target | met |", "| --- | --- | --- | --- |"]
    for name, value, target, unit in rows:
        shown = f"{value:.2f}{unit}" if unit else f"{value:.1f}"
        if target is None:  # reported, no target set
            table.append(f"| {name} | {shown} | - | - |")
            continue
        table.append(f"| {name} | {shown} | <= {target}{unit} | "
                     f"{'yes' if value <= target else 'no'} |")
    context = (f"{date.today()}, {platform.processor() or platform.machine()}, "
               f"{_cpu_model()}, Python {platform.python_version()}, "
               f"{framework} {_version(framework)}; plain step {best['plain_step']:.1f} ms, "
               f"plain run {best['plain_wall']:.1f} s ({steps} steps); ratios are medians "
               f"over {repeat} rounds, each against a plain run just before it")
    return "\n".join(table) + f"\n\nMeasured {context}.\n"


def _update(path: Path, text: str) -> None:
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    old = path.read_text() if path.exists() else f"# Benchmarks\n\n{begin}\n{end}\n"
    if begin not in old:
        old += f"\n{begin}\n{end}\n"
    head, rest = old.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}{end}{tail}")


def _cpu_model() -> str:
    from nondet.environment import cpu_model

    return cpu_model()


def _version(framework: str) -> str:
    from importlib.metadata import version

    return version("tensorflow-cpu" if framework == "tensorflow" else framework)


if __name__ == "__main__":
    main()
