"""nondet's benchmark: overheads as ratios against a plain run in the same invocation.

    python bench/bench.py [--framework torch|tensorflow] [--model reference|narrow]
                          [--steps N] [--repeat K] [--write docs/benchmarks.md]

Measures, for each framework on two CPU models (bench/model_torch.py and bench/model_tf.py:
the reference CNN with batch norm, dropout and Adam, and its narrow-activation variant,
``--narrow``, with 16-32 channels and a step of about 25 ms):

- step-level capture: median step time captured / plain (target <= 1.05); for torch
  also in one process (``bench/torch_backend_inprocess.py step --threads 2``: blocks of
  plain and captured steps alternating, so two processes' placement on the machine does
  not enter the ratio)
- op-level capture of every op: median step time captured / plain (target <= 1.5 torch,
  <= 2 TensorFlow), and per op against PyTorch's DebugMode logging a tensor hash of every
  op output (torch only; target: no dearer, or within 1.2x). For torch both costs are per
  aten op the step runs (DebugMode's count); TensorFlow's is per op record
- ``nondet run`` on the deterministic script: wall time / one plain run (target <= 2.2),
  and its peak resident memory (nondet and both runs) / twice one plain run's
- ``nondet run`` on a variant that diverges at step 0: wall time / one plain run of that
  variant (target <= 1.3)
- capture size: bytes per op record in memory and on disk (target <= 64), file bytes per
  step of a step-level and of an op-level capture

Each round runs every configuration right after a plain run and takes the ratio of the
two; the result is the median over ``--repeat`` rounds (on a noisy shared machine the
ratio of neighbours is steadier than either time). Timings are never asserted in tests;
this script reports them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from measure import (  # noqa: E402
    MARKERS,
    capture_per_step,
    captured_run,
    logged_ops,
    measured_line,
    median_ms,
    merge_tables,
    nondet_run,
    op_record_bytes,
    plain_run,
    replace_section,
    section,
    timed,
    uptime,
)

MODELS = {"torch": REPO / "bench" / "model_torch.py",
          "tensorflow": REPO / "bench" / "model_tf.py"}
VARIANTS = {"reference": [], "narrow": ["--narrow"]}
TARGETS = {"step": 1.05, "run_det": 2.2, "run_div": 1.3, "bytes": 64, "per_op": 1.2}
OPS_TARGET = {"torch": 1.5, "tensorflow": 2.0}  # DESIGN.md section 9
DEBUG_HASHES = ("norm", "hash_tensor")  # torch.utils._debug_mode's two built-in hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted([*MODELS, "comm"]), action="append",
                        help="benchmark only this framework (repeatable; default: all; "
                             "comm: a 2-rank DDP job, bench/bench_comm.py)")
    parser.add_argument("--model", choices=sorted(VARIANTS), action="append",
                        help="benchmark only this model (repeatable; default: both)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", type=Path, help="update this Markdown file's results table")
    opts = parser.parse_args()
    texts: list[str] = []
    # the tables this invocation does not measure stay as they were
    kept = section(opts.write, *MARKERS) if opts.write else ""
    frameworks = opts.framework or ["torch", "tensorflow", "comm"]
    for framework in [f for f in frameworks if f != "comm"]:
        for variant in opts.model or ["reference", "narrow"]:
            texts.append(bench(framework, variant, opts.steps, opts.repeat))
            print(texts[-1], flush=True)
            if opts.write:  # after each table: a long benchmark keeps what it measured
                replace_section(opts.write, merge_tables(kept, "\n".join(texts)), *MARKERS)
    if "comm" in frameworks:  # its own section of the file (bench_comm.py)
        import bench_comm

        comm_text = bench_comm.bench(opts.steps, opts.repeat)
        print(comm_text, flush=True)
        if opts.write:
            replace_section(opts.write, comm_text, *bench_comm.MARKERS)


def one_round(framework: str, variant: str, steps: int, out: Path) -> dict[str, float]:
    """Every measure once, each right after its own plain run (neighbours in time share the
    machine's mood, so the ratio of the two is steadier than either time)."""
    model = MODELS[framework]
    args = ["--steps", str(steps), *VARIANTS[variant]]
    noisy = [*args, "--unseeded-noise"]
    r: dict[str, float] = {}
    wall, step_ms, plain_peak = plain_run(model, args)
    r.update(plain_step=step_ms, plain_wall=wall)
    step_level, step_capture = captured_run(model, args, [], out / "step")
    r["step"] = step_level / step_ms
    _, step_ms, _ = plain_run(model, args)
    op_level, op_capture = captured_run(model, args, None, out / "ops")
    r["ops"] = op_level / step_ms
    r["step_bytes"], _ = capture_per_step(step_capture)
    r["op_bytes"], ops_per_step = capture_per_step(op_capture)
    r["record"], r["record_disk"] = op_record_bytes(op_capture)
    r["ops_per_step"] = ops_per_step
    r["per_op_us"] = (op_level - step_ms) * 1000 / ops_per_step
    if framework == "torch":
        # Per op the step runs (DebugMode's count of the aten ops it logged), for both: nondet
        # records some calls as one op (an optimizer kernel), so its record count would make
        # each of its records look dearer than the ops it stands for.
        op_overhead_ms = op_level - step_ms
        for name in DEBUG_HASHES:
            _, step_ms, _ = plain_run(model, args)
            _, output, _ = timed([sys.executable, str(model), *args, "--debug-mode", name])
            debug_ms = median_ms(output)
            r[f"debug_{name}"] = debug_ms / step_ms
            r[f"debug_{name}_per_op_us"] = (debug_ms - step_ms) * 1000 / logged_ops(output)
            r["per_op_us"] = op_overhead_ms * 1000 / logged_ops(output)
        cheaper = min(r[f"debug_{n}_per_op_us"] for n in DEBUG_HASHES)
        r["per_op_vs_debug"] = r["per_op_us"] / cheaper
    wall, _, plain_peak2 = plain_run(model, args)
    det, det_peak = nondet_run(model, args, out / "det")
    r["run_det"] = det / wall
    r["memory"] = det_peak / (2 * max(plain_peak, plain_peak2))
    wall, _, _ = plain_run(model, noisy)
    div, _ = nondet_run(model, noisy, out / "div", "--no-verify")  # diagnosis alone
    r["run_div"] = div / wall
    if variant == "reference":  # and with fix verification on (costs a pair per fix tried)
        wall, _, _ = plain_run(model, noisy)
        verified, _ = nondet_run(model, noisy, out / "verify")
        r["run_verify"] = verified / wall
    return r


def inprocess_step(variant: str) -> float:
    """Step-level capture of the torch model in one process, on two threads: the wall-time
    ratio of captured to plain steps, in blocks that alternate (torch_backend_inprocess.py)."""
    import re

    command = [sys.executable, str(REPO / "bench" / "torch_backend_inprocess.py"), "step",
               "--threads", "2", "--rounds", "10"]
    _, output, _ = timed(command + (["--reference"] if variant == "reference" else []))
    hit = re.search(r"wall plain [0-9.]+ ms, captured [0-9.]+ ms \(([0-9.]+)x\)", output)
    if not hit:
        raise SystemExit(f"no wall ratio in the in-process bench's output:\n{output[-2000:]}")
    return float(hit.group(1))


def bench(framework: str, variant: str, steps: int, repeat: int) -> str:
    """One framework's results table for one model, as Markdown."""
    rounds = []
    load_before = uptime()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            print(f"{framework} {variant}: round {i + 1}/{repeat}", file=sys.stderr)
            rounds.append(one_round(framework, variant, steps, Path(tmp) / str(i)))
    result = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    best = {key: min(r[key] for r in rounds) for key in ("plain_step", "plain_wall")}
    rows: list[tuple[str, float | None, float | None, str]] = [
        ("step-level capture, step time", result["step"], TARGETS["step"], "x"),
    ]
    if framework == "torch":
        print(f"{framework} {variant}: step-level capture in one process", file=sys.stderr)
        rows += [("step-level capture, step time in one process (2 threads)",
                  inprocess_step(variant), TARGETS["step"], "x")]
    rows += [
        ("op-level capture (every op), step time", result["ops"], OPS_TARGET[framework], "x"),
    ]
    if framework == "torch":
        rows += [(f"DebugMode + `log_tensor_hashes(\"{name}\")`, step time",
                  result[f"debug_{name}"], None, "x") for name in DEBUG_HASHES]
        rows += [("op-level capture, cost per op run (us)", result["per_op_us"], None, "us")]
        rows += [(f"DebugMode + {name} hash, cost per op run (us)",
                  result[f"debug_{name}_per_op_us"], None, "us") for name in DEBUG_HASHES]
        rows += [("op-level capture per op / cheaper DebugMode per op",
                  result["per_op_vs_debug"], TARGETS["per_op"], "x")]
    rows += [
        ("`nondet run`, deterministic script, wall", result["run_det"], TARGETS["run_det"], "x"),
        ("`nondet run --no-verify`, diverges at step 0, wall", result["run_div"],
         TARGETS["run_div"], "x"),
    ]
    if "run_verify" in result:
        rows.append(("`nondet run` (fixes verified), diverges at step 0, wall",
                     result["run_verify"], None, "x"))
    rows += [
        ("`nondet run` peak resident memory / two plain runs'", result["memory"], None, "x"),
        ("step-level capture, file bytes per step", result["step_bytes"], None, ""),
        ("op-level capture, file bytes per step", result["op_bytes"], None, ""),
        ("op records per step", result["ops_per_step"], None, ""),
        ("op record, in memory (bytes)", result["record"], TARGETS["bytes"], ""),
        ("op record, on disk after compression (bytes)", result["record_disk"],
         TARGETS["bytes"], ""),
    ]
    model = MODELS[framework].relative_to(REPO)
    flags = " ".join(VARIANTS[variant])
    table = [f"### {framework}, {variant} model ({model}{' ' + flags if flags else ''})", "",
             "| measure | result | target | met |", "| --- | --- | --- | --- |"]
    for name, value, target, unit in rows:
        assert value is not None
        shown = f"{value:.2f}{unit}" if unit else f"{value:,.1f}"
        if target is None:  # reported, no target set
            table.append(f"| {name} | {shown} | - | - |")
            continue
        if value < 0:  # a cost below the plain step's: noise larger than the effect
            table.append(f"| {name} | {shown} | <= {target}{unit} | not measurable |")
            continue
        table.append(f"| {name} | {shown} | <= {target}{unit} | "
                     f"{'yes' if value <= target else 'no'} |")
    setup = (f"plain step {best['plain_step']:.1f} ms, plain run {best['plain_wall']:.1f} s "
             f"({steps} steps)")
    return "\n".join(table) + "\n\n" + measured_line(framework, setup, repeat, "plain run",
                                                      load_before)


if __name__ == "__main__":
    main()
