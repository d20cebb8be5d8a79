"""The comm row of nondet's benchmark: a 2-rank DDP job (bench/model_ddp.py, gloo, CPU)
under nondet against a plain torchrun of the same script.

    python bench/bench_comm.py [--steps N] [--repeat K] [--write docs/benchmarks.md]

(``bench/bench.py --framework comm`` runs it too.) Measures, each round right after a
plain ``torchrun --standalone --nproc-per-node 2`` of the script:

- one captured job, step-level only (no op window: collectives not recorded): median step
  time of rank 0 / plain;
- one captured job with op-level capture at every step, collectives included (inputs
  hashed before the call, outputs after the wait, DDP's buckets after the backward): median
  step time / plain, and the collective records per step;
- ``nondet run --no-verify --nproc-per-node 2`` (two jobs, op-level at init and step 0,
  compared rank by rank): wall time / one plain torchrun.

No target is set for comm capture (DESIGN.md section 9: reported as ratios). The result is
the median over ``--repeat`` rounds.
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

import measure  # noqa: E402
from measure import median_ms, timed  # noqa: E402

MODEL = REPO / "bench" / "model_ddp.py"
LAUNCH = ("--nproc-per-node", "2")
MARKERS = ("<!-- bench-comm:begin -->", "<!-- bench-comm:end -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", type=Path, help="update this Markdown file's comm section")
    opts = parser.parse_args()
    text = bench(opts.steps, opts.repeat)
    print(text, flush=True)
    if opts.write:
        measure.replace_section(opts.write, text, *MARKERS)


def one_round(steps: int, out: Path) -> dict[str, float]:
    args = ["--steps", str(steps)]
    plain_wall, plain_out, _ = timed([sys.executable, "-m", "torch.distributed.run",
                                      "--standalone", *LAUNCH, str(MODEL), *args])
    plain_step = median_ms(plain_out)
    step_level = _captured_job(args, [], out / "step")
    op_level, comm_rows = _captured_job(args, None, out / "ops", count_comm=True)
    run_wall, _, _ = timed([sys.executable, "-m", "nondet", "run", "-q", "--no-verify",
                            "--out", str(out / "run"), "--nproc-per-node", "2", str(MODEL),
                            *args])
    return {"plain_step": plain_step, "plain_wall": plain_wall,
            "step": step_level[0] / plain_step, "ops": op_level / plain_step,
            "comm_rows": comm_rows, "run": run_wall / plain_wall}


def _captured_job(args: list[str], op_steps: list[int] | None, out: Path,
                  count_comm: bool = False) -> tuple[float, float]:
    """(rank 0's median step ms, collective records per step) of one job under capture."""
    from nondet.distributed import Job
    from nondet.jobs import check_job
    from nondet.launch import Plan, Target
    from nondet.store import open_capture

    target = Target(script=str(MODEL), module=None, args=tuple(args), launcher=LAUNCH)
    result = check_job(Job(target, Plan("ops" if op_steps is None else "step", op_steps), 0,
                           out).run())
    per_step = 0.0
    if count_comm:
        rank0 = next(r.path for r in result.ranks if r.label.endswith("rank0"))
        comm = open_capture(rank0).comm
        steps = {int(s) for s in comm["step"] if int(s) >= 0}
        per_step = float(sum(int(s) >= 0 for s in comm["step"])) / max(1, len(steps))
    return median_ms(result.log_path.read_text()), per_step


def bench(steps: int, repeat: int) -> str:
    rounds = []
    load_before = measure.uptime()
    with tempfile.TemporaryDirectory(prefix="nondet-bench-comm-") as tmp:
        for i in range(repeat):
            rounds.append(one_round(steps, Path(tmp) / f"round{i}"))
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    rows = [
        ("captured job, step level (collectives not recorded), step time", med["step"]),
        ("captured job, op level with collectives at every step, step time", med["ops"]),
        ("`nondet run --nproc-per-node 2` (two jobs, op level at init and step 0), wall",
         med["run"]),
    ]
    table = ["| measure | ratio to plain torchrun |", "| --- | --- |"]
    table += [f"| {name} | {value:.2f}x |" for name, value in rows]
    setup = (f"gloo, 2 ranks, {steps} steps; plain step {med['plain_step']:.1f} ms, plain "
             f"torchrun {med['plain_wall']:.1f} s; {med['comm_rows']:.0f} collective records "
             "per op-level step")
    line = measure.measured_line("torch", setup, repeat, "plain torchrun", load_before)
    return "\n".join(table) + "\n\n" + line


if __name__ == "__main__":
    main()
