"""torchrun jobs end to end (gloo, CPU, 2 ranks): each test launches two jobs of 2 ranks.

Few and small: the DDP race found on the right rank, its fix verified on every rank of
two more jobs, a race from step 1 narrowed down by two more jobs, ``check --runs 3``, the
control (no verification jobs), one rank killed in run b only (exit 2 naming run and
rank, no process left), and a hanging rank ended within a bounded time, in a first job
and in a verification job (with a short stall bound)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import h5py
import pytest

from nondet import compare, distributed, job_fixes, jobrun, pipeline, recipe
from nondet.jobrun import JobHung
from nondet.launch import Plan, Target
from nondet.records import CommOutput
from nondet.store import open_capture
from tests.conftest import REPO, run_cli, step_rows, write_capture
from tests.e2e.fixture_cases import cases, check_finding

pytestmark = pytest.mark.e2e

FIXTURES = REPO / "fixtures" / "ddp"
RACE = next(c for c in cases(FIXTURES) if c.script.name == "index_put_ddp.py" and not c.args)
CONTROL = REPO / "fixtures" / "ddp" / "linear_ddp.py"
#: The CLI's result and JSON report (None when none was written) of one ``nondet run``.
RaceRun = tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]
#: The stall bound of the hang tests: longer than a rank's start-up on a loaded machine
#: (torchrun, then torch imported by each rank: at load 14 no rank reached nondet within
#: 5 s and the job was ended before rank 0 could show that rank 1 alone was silent), far
#: below gloo's 30 min.
HANG_STALL = 15.0


def _processes_mentioning(text: str) -> list[int]:
    """Our processes whose environment names ``text`` (the test's own tmp_path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if text.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def race_run(tmp_path_factory: pytest.TempPathFactory) -> RaceRun:
    """One ``nondet run`` of the DDP race with fix verification, shared by the tests that
    check its finding and its verified fix (two jobs of 2 ranks, then two more: the
    slowest launch of this file, run once)."""
    tmp_path = tmp_path_factory.mktemp("race")
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "--json", str(report_path),
                     "torchrun", "--nproc-per-node", "2", str(RACE.script.relative_to(REPO)),
                     cwd=REPO)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return result, report


def test_ddp_race_is_found_at_the_backward_op_of_rank_1(race_run: RaceRun,
                                                        tmp_path: Path) -> None:
    result, report = race_run
    found = check_finding(RACE, result, report)
    assert found is not None and report is not None
    assert found["rank"] == int(RACE.expected["rank"]) and found["world_size"] == 2
    assert ", rank 1: aten.index_put.default" in result.stdout.splitlines()[0]
    ranks = sorted(Path(r["path"]).relative_to(Path(r["path"]).parents[1]).as_posix()
                   for r in report["runs"])
    assert ranks == ["run-a/rank0.h5", "run-a/rank1.h5", "run-b/rank0.h5", "run-b/rank1.h5"]
    for run in report["runs"]:
        with h5py.File(run["path"], "r") as f:
            assert int(f.attrs["world_size"]) == 2
            assert int(f.attrs["rank"]) == int(run["path"][-4])
    run_dir = Path(report["runs"][0]["path"]).parents[1]
    again = run_cli("diff", "--json", str(tmp_path / "diff.json"), str(run_dir / "run-a"),
                    str(run_dir / "run-b"))
    assert again.returncode == 1, again.stdout + again.stderr
    diffed = json.loads((tmp_path / "diff.json").read_text())["first_divergence"]
    assert (diffed["kind"], diffed["op"], diffed["rank"]) == ("op", found["op"], 1)
    shown = run_cli("show", report["runs"][1]["path"]).stdout
    assert any(line.split() == ["rank", "1"] for line in shown.splitlines())
    assert any(line.split() == ["world_size", "2"] for line in shown.splitlines())


def test_the_ddp_race_fix_is_verified_on_every_rank_of_two_more_jobs(race_run: RaceRun) -> None:
    result, report = race_run
    assert result.returncode == 1, result.stdout + result.stderr
    assert report is not None, result.stderr
    found = report["first_divergence"]
    assert (found["kind"], found["step"], found["rank"], found["op"]) == (
        "op", 0, 1, "aten.index_put.default"), found
    fix = report["suggestions"][0]
    assert (fix["id"], fix["verified"], fix["verified_with"]) == (
        "PT-GETITEM-CPU", True, "torch.deterministic"), fix
    assert fix["verified_steps"] == 2  # the job's 2 steps: finding step 0 + a few, capped
    assert report["combined_fix"]["verified"] is True
    assert "verified: with torch.use_deterministic_algorithms(True)" in result.stdout
    run_dir = Path(report["runs"][0]["path"]).parents[1]
    for rank in (0, 1):  # every rank got the fix and repeated, not only the one compared
        a, b = (open_capture(run_dir / f"run-{label}-fix1" / f"rank{rank}.h5")
                for label in ("a", "b"))
        assert compare.first_step_divergence(a.steps, b.steps) is None
        assert sorted(int(s) for s in a.steps["step"] if s >= 0) == [0, 1]
        assert f"run-a-fix1/rank{rank}.h5" in " ".join(report["captures"])
    log = (run_dir / "run-a-fix1.log").read_text()
    assert "could not apply" not in log


def test_a_job_that_parts_after_step_0_is_narrowed_down_to_the_op(tmp_path: Path) -> None:
    # the first jobs record ops at init and step 0; the race starts at step 1
    case = next(c for c in cases(FIXTURES)
                if c.script.name == "index_put_ddp.py" and c.args == ("--race-from", "1"))
    case = replace(case, source_line=RACE.source_line)  # the same line: one marker a line
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), "torchrun", "--nproc-per-node", "2",
                     str(case.script.relative_to(REPO)), *case.args, cwd=REPO)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    found = check_finding(case, result, report)
    assert found is not None and report is not None and found["rank"] == 1
    assert any("op-level recording was re-run" in n for n in found["notes"])
    ops = [c for c in report["captures"] if "/run-a-ops/" in c or "/run-b-ops/" in c]
    assert sorted(Path(c).name for c in ops) == ["rank0.h5", "rank0.h5", "rank1.h5", "rank1.h5"]
    for capture in ops:  # stopped on every rank at the finding's step boundary
        assert max(int(s) for s in open_capture(Path(capture)).steps["step"]) == 1


def test_check_runs_3_on_a_job_gives_the_table_and_the_rank(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = run_cli("check", "--runs", "3", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), "torchrun", "--nproc-per-node", "2",
                     str(RACE.script.relative_to(REPO)), "--steps", "1", cwd=REPO)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("nondet check: FAIL"), result.stdout
    report = json.loads(report_path.read_text())
    rows = report["repeatability"]["runs"]
    assert [r["label"] for r in rows] == ["r1", "r2", "r3"] and len(report["runs"]) == 6
    # one step each; the race parts the jobs' step rows (gradients), while their final
    # weights may round to the same bits after one update: outcome letters may all match
    assert [r["steps"] for r in rows] == [1, 1, 1]
    found = report["first_divergence"]
    assert (found["step"], found["rank"], found["op"]) == (0, 1, "aten.index_put.default")
    assert not any("fix" in Path(r["path"]).parent.name for r in report["runs"])


def test_baseline_is_refused_for_a_job_in_one_line(tmp_path: Path) -> None:
    result = run_cli("check", "--update-baseline", "--baseline", str(tmp_path / "b.h5"),
                     "--out", str(tmp_path / "out"), "torchrun", "--nproc-per-node", "2",
                     str(CONTROL.relative_to(REPO)), cwd=REPO)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--baseline is not available for torchrun jobs" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "b.h5").exists()


def test_ddp_control_is_deterministic_and_keeps_the_users_omp_setting(
        tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), "--nproc-per-node", "2",
                     str(CONTROL.relative_to(REPO)), cwd=REPO,
                     env={"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["verdict"] == "deterministic" and len(report["runs"]) == 4
    outputs = set()
    for run in report["runs"]:
        capture = open_capture(Path(run["path"]))
        assert capture.env.get("env.OMP_NUM_THREADS") == "2"  # torchrun would have set 1
        # DDP's gradient all-reduce at step 0: bucket 0 (every gradient of the 16-8-1
        # model, float32), its output read after the backward, the same on both ranks
        bucket = [r for r in capture.comm if int(r["step"]) == 0 and int(r["bucket"]) >= 0]
        assert [(int(r["bucket"]), int(r["nbytes"]), int(r["group_size"]), int(r["output"]))
                for r in bucket] == [(0, (16 * 8 + 8 + 8 + 1) * 4, 2, CommOutput.AFTER_BACKWARD)]
        assert capture.string(int(bucket[0]["backend"])) == "gloo"
        record = next(r for r in capture.ops(0) if int(r["index"]) == int(bucket[0]["index"]))
        assert capture.string(int(record["name"])) == "c10d.allreduce_.default"
        outputs.add(int(record["out_fp"]))
    assert len(outputs) == 1 and 0 not in outputs  # all-reduced: one value on every rank
    run_dir = Path(report["runs"][0]["path"]).parents[1]
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["run-a", "run-b"]


def test_a_rank_killed_in_run_b_is_exit_2_naming_run_and_rank(tmp_path: Path) -> None:
    marker = tmp_path / "first-launch"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"),
                     "--nproc-per-node", "2", str(CONTROL.relative_to(REPO)),
                     "--fail-rank", "1", "--marker", str(marker), "--how", "kill", cwd=REPO)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "run b, rank 1" in result.stderr
    assert "Traceback" not in result.stderr
    assert _processes_mentioning(str(tmp_path)) == []


def test_a_hanging_rank_ends_the_job_in_bounded_time_and_leaves_nothing(
        tmp_path: Path) -> None:
    marker = tmp_path / "first-launch"
    marker.write_text("the first launch was before this test\n")  # rank 1 hangs now
    target = Target(script=str(CONTROL), module=None,
                    args=("--fail-rank", "1", "--marker", str(marker), "--how", "hang"),
                    launcher=("--nproc-per-node", "2"))
    job = distributed.Job(target, Plan("b", []), 0, tmp_path, stall_after=HANG_STALL)
    started = time.monotonic()
    result = job.run()
    elapsed = time.monotonic() - started
    with pytest.raises(JobHung, match=r"run b: ranks? .*1.* sent nothing"):
        jobrun.check_job(result)
    assert elapsed < 90, elapsed  # start-up + HANG_STALL + the ending, never gloo's 30 min
    assert result.hung and 1 in result.hung
    assert _processes_mentioning(str(tmp_path)) == []
    assert all(not job._is_our_worker(s.pid) for s in job.ranks.values())


def test_a_job_that_hangs_while_a_fix_is_verified_is_exit_2_naming_run_and_rank(
        tmp_path: Path) -> None:
    # not "the fix did not help": a hang is no answer about the fix
    marker = tmp_path / "first-launch"
    marker.write_text("the first launch was before this test\n")  # rank 1 hangs at step 1
    target = Target(script=str(CONTROL), module=None,
                    args=("--fail-rank", "1", "--marker", str(marker), "--how", "hang"),
                    launcher=("--nproc-per-node", "2"))
    options = pipeline.Options(out_dir=tmp_path, verify=True)
    steps = job_fixes.JobSteps(target, options, lambda _: None, stall_after=HANG_STALL)
    first = [write_capture(tmp_path / f"{x}.h5", step_rows(
        *({"step": i, "params_fp": fp, "wall": i + 1.0} for i, fp in enumerate(fps))))
        for x, fps in (("a", [1, 2, 3]), ("b", [1, 9, 9]))]
    by_id = {r.id: r for r in recipe.load()}
    fix = recipe.Suggestion(by_id["PT-GETITEM-CPU"], "torch.use_deterministic_algorithms(True)",
                            "code", "", True)
    started = time.monotonic()
    with pytest.raises(JobHung, match=r"run a-fix1: ranks? .*1.* sent nothing"):
        steps.verify((), tmp_path, [fix], (open_capture(first[0]), open_capture(first[1])), 1)
    assert time.monotonic() - started < 90  # start-up + HANG_STALL s of silence + the ending
    assert _processes_mentioning(str(tmp_path)) == []


def test_a_receive_from_any_source_is_a_collective_finding_on_rank_0(tmp_path: Path) -> None:
    case = next(c for c in cases(FIXTURES)
                if c.script.name == "anysource_recv.py" and not c.args)
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), "--nproc-per-node", "3",
                     str(case.script.relative_to(REPO)), cwd=REPO)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    found = check_finding(case, result, report)
    assert found is not None and found["rank"] == 0 and found["world_size"] == 3
    assert "the collective c10d.recv_any_source_.default creates the difference: its output " \
        "differs while every rank's inputs matched (gloo, group of 3)" in \
        result.stdout.splitlines()[0]
    # found at the collective's own record, its output read after the script's wait
    focus = next(c for c in found["context"] if c["focus"])
    assert (focus["op"], focus["state"]) == ("c10d.recv_any_source_.default",
                                             "differs (inputs same)")
    assert found["collective"] == {
        "backend": "gloo", "group_size": 3, "bucket": None, "nbytes": 256,
        "ddp_bucket": False, "output_read": "read after Work.wait()",
        "summary": "gloo, group of 3"}
    table = next(n for n in found["notes"] if "rank x phase" in n)
    rows = dict(part.split(": ", 1) for part in table.split("; ")[1:])
    columns = table.split("; ")[0].rsplit(": ", 1)[1].split()
    assert rows["rank 0"].split()[columns.index("comm")] == "x"  # where it was made
    assert set(rows["rank 1"].split()) <= {"=", "."} and set(rows["rank 2"].split()) <= {"=", "."}


def test_receives_from_named_sources_in_a_fixed_order_are_deterministic(
        tmp_path: Path) -> None:
    """The control of the collective fixture: every receive's output is fingerprinted after
    its wait, and nothing differs."""
    case = next(c for c in cases(FIXTURES)
                if c.script.name == "anysource_recv.py" and c.args == ("--fixed-order",))
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), "--nproc-per-node", "3",
                     str(case.script.relative_to(REPO)), *case.args, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    for run in json.loads(report_path.read_text())["runs"]:
        capture = open_capture(Path(run["path"]))
        names = {int(o["index"]): capture.string(int(o["name"])) for o in capture.ops(0)}
        received = [r for r in capture.comm if int(r["step"]) == 0
                    and names[int(r["index"])] == "c10d.recv_.default"]
        if int(capture.attrs["rank"]) == 0:  # 2 senders x 10 rounds, each read after wait
            assert len(received) == 20
            assert all(int(r["output"]) == CommOutput.AFTER_WAIT for r in received)


def test_a_replica_that_drifts_is_a_desync_even_when_the_runs_agree(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), "--nproc-per-node", "2",
                     str(CONTROL.relative_to(REPO)), "--drift-rank", "1", cwd=REPO)
    assert result.returncode == 1, result.stdout + result.stderr
    found = json.loads(report_path.read_text())["first_divergence"]
    assert (found["kind"], found["step"], found["rank"]) == ("desync", 1, 1), result.stdout
    assert "rank 1's parameters differ from rank 0's" in result.stdout



def test_zero_redundancy_optimizer_replicas_are_compared_after_its_broadcast(
        tmp_path: Path) -> None:
    """Trial: DDP with ``ZeroRedundancyOptimizer`` was "a replica's parameters drift from
    rank 0's" at step 0 (exit 1): the step ended when ZeRO's local optimizer returned, each
    rank with only its own shard updated, before ZeRO broadcast the shards."""
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), "--nproc-per-node", "2",
                     str(CONTROL.relative_to(REPO)), "--zero", cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["verdict"] == "deterministic"
    assert [run["steps"] for run in report["runs"]] == [3, 3, 3, 3]  # one per opt.step()

def test_two_node_agents_on_one_machine_each_capture_their_own_ranks(tmp_path: Path) -> None:
    """Multi-node as on a cluster: the same command on every node (here two nondet
    processes on 127.0.0.1, one rank each); each node's runs a and b rendezvous with the
    other node's, each node captures and compares its own ranks."""
    import socket
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = {**os.environ, "NO_COLOR": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "nondet", "run", "-q", "--no-verify", "--out",
         str(tmp_path / f"node{n}"), "--json", str(tmp_path / f"node{n}.json"), "torchrun",
         "--nnodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1",
         "--master-port", port, "--nproc-per-node", "1", str(CONTROL.relative_to(REPO))],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for n in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    for n, (node, output) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, output
        report = json.loads((tmp_path / f"node{n}.json").read_text())
        assert report["verdict"] == "deterministic"
        assert sorted(Path(r["path"]).name for r in report["runs"]) == [f"rank{n}.h5"] * 2


def test_a_data_shard_that_differs_on_one_rank_is_found_on_that_rank(tmp_path: Path) -> None:
    # and not as a collective on rank 0, whose all-reduce received rank 1's difference
    case = next(c for c in cases(FIXTURES)
                if c.script.name == "shard_one_rank.py" and not c.args)
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), "--nproc-per-node", "2",
                     str(case.script.relative_to(REPO)), cwd=REPO)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    found = check_finding(case, result, report)
    assert found is not None and found["rank"] == int(case.expected["rank"])
