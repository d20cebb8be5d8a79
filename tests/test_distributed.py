"""The torchrun launch line (nondet.distributed) and the rank-aware choice (nondet.jobs)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from nondet import (
    channel,
    distributed,
    job_fixes,
    job_narrow,
    jobrun,
    jobs,
    launchline,
    pipeline,
    repeatability,
)
from nondet.errors import NondetError, ScriptFailed
from nondet.launch import RunResult, Target
from nondet.report import Divergence
from tests.conftest import run_cli, step_rows, write_capture

SCRIPT = "fixtures/ddp/linear_ddp.py"


@pytest.mark.parametrize("words, module", [
    (("torchrun", "--nproc-per-node", "2", SCRIPT, "--steps", "2"), None),
    (("python", "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT, "--steps",
      "2"), None),
    (("--nproc-per-node", "2", SCRIPT, "--steps", "2"), "torch.distributed.run"),
])
def test_launch_line_forms_keep_torchrun_options_and_the_script_args(
        words: tuple[str, ...], module: str | None) -> None:
    assert launchline.is_launch_line(words, module)
    target = launchline.parse_launch_line(words, module)
    assert target.launcher == ("--nproc-per-node", "2")
    assert target.script == SCRIPT and target.module is None
    assert target.args == ("--steps", "2")  # the script's, even where torchrun has one too


def test_a_module_launched_by_torchrun_stays_a_module() -> None:
    target = launchline.parse_launch_line(
        ("torchrun", "--standalone", "--nproc-per-node=2", "-m", "pkg.train", "--lr", "1"),
        None)
    assert target.module == "pkg.train" and target.script is None
    assert target.launcher == ("--standalone", "--nproc-per-node=2")
    assert target.args == ("--lr", "1")


def test_a_script_that_is_not_a_launch_line() -> None:
    assert not launchline.is_launch_line(("train.py", "torchrun"), None)
    assert not launchline.is_launch_line(("python", "train.py"), None)
    assert not launchline.is_launch_line((), "pkg.train")



def test_torchrun_given_by_its_path_is_the_launch_line(tmp_path: Path) -> None:
    """``nondet run $(which torchrun) ...``: the console script pip writes. Before, the file
    was run as the script (its workers unrecorded: "no training step was observed")."""
    entry = tmp_path / "bin" / "torchrun"
    entry.parent.mkdir()
    entry.write_text("#!/usr/bin/python3\nimport sys\nfrom torch.distributed.run import main\n"
                     "if __name__ == '__main__':\n    sys.exit(main())\n")
    words = (str(entry), "--nproc-per-node", "2", SCRIPT, "--steps", "2")
    assert launchline.is_launch_line(words, None)
    target = launchline.parse_launch_line(words, None)
    assert target.script == SCRIPT and target.launcher == ("--nproc-per-node", "2")
    # a script of the user's that is called torchrun stays a script
    own = tmp_path / "torchrun"
    own.write_text("import torch\nprint('training')\n")
    assert not launchline.is_launch_line((str(own), "--epochs", "1"), None)


def test_no_python_is_refused_in_one_line() -> None:
    with pytest.raises(NondetError, match="--no-python"):
        launchline.parse_launch_line(("torchrun", "--no-python", "echo", "hi"), None)


def test_a_torchrun_line_without_script_is_a_usage_error_not_a_traceback(
        tmp_path: Path) -> None:
    result = run_cli("run", "--out", str(tmp_path), "torchrun", "--nproc-per-node", "2")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "torchrun launch line" in result.stderr


def test_nproc_per_node_with_a_launch_line_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli("run", "--out", str(tmp_path), "--nproc-per-node", "2", "torchrun",
                     "--nproc-per-node", "2", SCRIPT)
    assert result.returncode == 2
    assert "give it to torchrun" in result.stderr


def _rank(label: str, rank: int, status: str, code: int = 0, error: str = "") -> RunResult:
    return RunResult(label=f"{label}/rank{rank}", path=Path(f"rank{rank}.h5"),
                     log_path=Path("job.log"), status=status, exit_code=code, steps=1,
                     error=error)


def test_the_rank_that_failed_first_is_named_not_the_ones_failing_after_it() -> None:
    job = distributed.JobResult(
        label="b", agent_exit_code=1, log_path=Path("run-b.log"), world_size=2,
        ranks=[_rank("b", 0, channel.CRASHED, -1), _rank("b", 1, channel.FAILED, 1,
                                                          "RuntimeError: boom")],
        ended_first=[1, 0])
    with pytest.raises(ScriptFailed, match=r"run b, rank 1 \(exit code 1\): RuntimeError"):
        jobrun.check_job(job)


def test_a_killed_rank_is_the_one_that_ended_first() -> None:
    job = distributed.JobResult(
        label="a", agent_exit_code=1, log_path=Path("run-a.log"), world_size=2,
        ranks=[_rank("a", 0, channel.CRASHED, -1), _rank("a", 1, channel.CRASHED, -1)],
        ended_first=[1, 0])
    with pytest.raises(ScriptFailed, match=r"run a, rank 1 .*killed by a signal"):
        jobrun.check_job(job)
    # its peer then fails in the all-reduce (gloo: connection closed): still rank 1
    job.ranks[0] = _rank("a", 0, channel.FAILED, 1, "RuntimeError: Connection closed by peer")
    with pytest.raises(ScriptFailed, match=r"run a, rank 1 .*killed by a signal"):
        jobrun.check_job(job)


def test_an_op_that_made_the_difference_outranks_a_collective_on_another_rank() -> None:
    # DDP: rank 0's all-reduce output differs while its own inputs matched, because rank
    # 1's backward fed it the difference; the op on rank 1 is the finding.
    carried = Divergence(kind="op", step=0, phase="backward", op="c10d.allreduce_.default",
                         op_index=5)
    made = Divergence(kind="op", step=0, phase="backward", op="aten.index_put.default",
                      op_index=16)
    assert jobs._order(1, made) < jobs._order(0, carried)
    read_after = Divergence(kind="entry", step=0, phase="optimizer",
                            op="external:tensor float32[2000, 32]", op_index=3)
    assert jobs._order(1, made) < jobs._order(0, read_after)
    later = Divergence(kind="op", step=1, phase="backward", op="aten.index_put.default",
                       op_index=1)
    assert jobs._order(0, carried) < jobs._order(1, later)  # an earlier step still wins


def test_a_job_silent_before_any_rank_connected_says_so() -> None:
    # e.g. torchrun waiting for a rendezvous that never completes: not "before any rank
    # started" with torchrun's exit code, which would blame the script
    job = distributed.JobResult(label="a", agent_exit_code=-1, log_path=Path("run-a.log"),
                                ranks=[], stalled=True, silence=120.0)
    with pytest.raises(jobrun.JobHung, match="no rank reached nondet or sent anything for 120 s"):
        jobrun.check_job(job)


def _steps(*fps: int) -> Any:
    rows = np.array([(i - 1, fp) for i, fp in enumerate(fps)],
                    dtype=[("step", "<i8"), ("params_fp", "<u8")])
    return SimpleNamespace(steps=rows)  # what first_desync reads of a Capture


def test_a_replica_that_stops_matching_rank_0_is_a_desync() -> None:
    found = jobs.first_desync({0: _steps(1, 2, 3, 4), 1: _steps(1, 2, 9, 9)}, "a")
    assert found is not None
    rank, div = found
    assert (rank, div.kind, div.step, div.rank) == (1, "desync", 1, 1)


def test_shards_that_never_matched_are_not_replicas_and_never_a_desync() -> None:
    # model parallel / FSDP: each rank holds other parameters from the start
    assert jobs.first_desync({0: _steps(1, 2, 3), 1: _steps(5, 6, 7)}, "a") is None
    assert jobs.first_desync({0: _steps(1, 2, 3), 1: _steps(1, 2, 3)}, "a") is None


def test_diff_takes_two_run_directories_or_two_files_not_one_of_each(tmp_path: Path) -> None:
    (tmp_path / "run-a").mkdir()
    (tmp_path / "b.h5").write_bytes(b"")
    mixed = run_cli("diff", str(tmp_path / "run-a"), str(tmp_path / "b.h5"))
    assert mixed.returncode == 2 and "not one of each" in mixed.stderr
    (tmp_path / "run-b").mkdir()
    empty = run_cli("diff", str(tmp_path / "run-a"), str(tmp_path / "run-b"))
    assert empty.returncode == 2 and "holds no rank<R>.h5 capture" in empty.stderr
    assert "Traceback" not in empty.stderr


def _job(tmp_path: Path, label: str, params: dict[int, list[int]]) -> distributed.JobResult:
    """A finished job whose rank R's step rows hold ``params[R]`` as parameter fingerprints."""
    ranks = []
    for rank, fps in params.items():
        rows = step_rows(*({"step": i, "params_fp": fp, "wall": i + 1.0}
                           for i, fp in enumerate(fps)))
        (tmp_path / f"run-{label}").mkdir(exist_ok=True)
        path = write_capture(tmp_path / f"run-{label}" / f"rank{rank}.h5", rows)
        ranks.append(RunResult(f"{label}/rank{rank}", path, tmp_path / "job.log", "complete", 0,
                               len(fps)))
    return distributed.JobResult(label=label, ranks=ranks, agent_exit_code=0,
                                 log_path=tmp_path / "job.log", world_size=len(params))


def test_verification_compares_the_rank_that_parts_first(tmp_path: Path) -> None:
    # rank 0 repeats; rank 1 parts at step 2: verify.py must see rank 1's pair, else a fix
    # would look verified while a rank still parts
    ja = _job(tmp_path, "a", {0: [1, 2, 3, 4], 1: [1, 2, 3, 4]})
    jb = _job(tmp_path, "b", {0: [1, 2, 3, 4], 1: [1, 2, 7, 8]})
    steps = job_fixes.JobSteps(Target("x.py", None), pipeline.Options(), lambda _: None)
    ra, rb = steps.representative(ja, jb)
    assert (ra.label, rb.label) == ("a/rank1", "b/rank1")
    # none parts: the rank that ran fewest steps, so "repeated" holds for every rank
    jc = _job(tmp_path, "c", {0: [1, 2, 3, 4], 1: [1, 2, 3]})
    jd = _job(tmp_path, "d", {0: [1, 2, 3, 4], 1: [1, 2, 3]})
    assert steps.representative(jc, jd)[0].label == "c/rank1"


def test_jobs_share_a_letter_only_if_every_rank_ended_alike() -> None:
    same, other = [(11, 3, 0.5), (22, 3, 0.5)], [(11, 3, 0.5), (23, 3, 0.5)]
    rows = repeatability.rows(["r1", "r2", "r3"], ["complete"] * 3, [same, other, same])
    assert [r.outcome for r in rows] == ["A", "B", "A"]
    assert rows[0].digest == rows[2].digest != rows[1].digest


def test_only_a_step_level_finding_outside_the_op_window_is_narrowed() -> None:
    window = [-1, 0]
    step_level = Divergence(kind="op", step=2, phase="backward", localized=False)
    assert job_narrow.needs_narrowing(step_level, window)
    assert not job_narrow.needs_narrowing(step_level, None)  # --ops all: nothing to re-run
    assert not job_narrow.needs_narrowing(step_level, [-1, 1, 2])  # the re-run's own window
    assert not job_narrow.needs_narrowing(
        Divergence(kind="op", step=2, phase="backward", op="aten.mm.default", op_index=4),
        window)
    assert job_narrow.needs_narrowing(Divergence(kind="entry", step=3, phase="data"), window)
    assert not job_narrow.needs_narrowing(
        Divergence(kind="structure", step=2, phase="other", localized=False), window)
