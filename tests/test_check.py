"""``nondet check``: every outcome's exit code, JUnit against a schema, baselines, --runs,
GitHub annotations, and the CI examples in the docs."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from lxml import etree

from nondet.store import open_capture
from tests.conftest import REPO, run_cli, step_rows, write_capture

pytest.importorskip("torch")

SCRIPTS = REPO / "tests" / "data" / "scripts"
STEPS = str(SCRIPTS / "steps.py")
UNSEEDED = str(SCRIPTS / "unseeded.py")
SCHEMA = etree.XMLSchema(etree.parse(str(REPO / "tests" / "data" / "junit.xsd")))


def _junit(path: Path) -> etree._ElementTree:
    doc = etree.parse(str(path))
    assert SCHEMA.validate(doc), SCHEMA.error_log
    return doc


def test_identical_runs_pass_with_one_line(tmp_path: Path) -> None:
    result = run_cli("check", "--junit", "j.xml", STEPS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"nondet check: PASS — {STEPS}: deterministic: 2 runs bitwise identical over 3 steps"]
    assert result.stderr == ""  # quiet by default
    doc = _junit(tmp_path / "j.xml")
    assert doc.getroot().get("failures") == "0" and not doc.findall(".//failure")


def test_nondeterminism_fails_with_finding_and_fix_in_junit(tmp_path: Path) -> None:
    result = run_cli("check", "--junit", "j.xml", "--json", "r.json", UNSEEDED, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    line = result.stdout.strip()
    assert line.startswith("nondet check: FAIL") and "torch.from_numpy" in line
    assert "fix: rng = np.random.default_rng(seed) [PY-NP-GENERATOR]" in line
    failure = _junit(tmp_path / "j.xml").find(".//testcase/failure")
    assert failure is not None and "PY-NP-GENERATOR" in failure.get("message")
    assert "unseeded.py:11" in failure.text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "nondeterministic" and report["exit_code"] == 1


def test_github_annotation_points_at_the_source_line(tmp_path: Path) -> None:
    # The script lies outside the cwd: it is annotated as a path inside the checkout.
    result = run_cli("check", UNSEEDED, cwd=tmp_path, env={"GITHUB_ACTIONS": "true",
                                                            "GITHUB_WORKSPACE": str(REPO)})
    assert result.returncode == 1
    annotation = result.stdout.splitlines()[0]
    pattern = r"::error file=.*unseeded\.py,line=11,title=nondet: nondeterminism::"
    assert re.match(pattern, annotation)


def test_script_failure_is_exit_2_and_a_junit_error(tmp_path: Path) -> None:
    result = run_cli("check", "--junit", "j.xml", STEPS, "--fail-at", "0", cwd=tmp_path)
    assert result.returncode == 2
    assert "the script failed in run a" in result.stderr
    error = _junit(tmp_path / "j.xml").find(".//testcase/error")
    assert error is not None and "ValueError: boom" in error.get("message")


def test_baseline_round_trip_is_small_and_passes(tmp_path: Path) -> None:
    baseline = tmp_path / "ci" / "baseline.h5"
    made = run_cli("check", "--update-baseline", "--baseline", str(baseline), STEPS,
                   "--steps", "4", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "baseline written" in made.stdout
    assert baseline.stat().st_size < 128 * 1024
    stored = open_capture(baseline)
    assert stored.n_steps == 4 and stored.op_steps() == []  # step level only
    result = run_cli("check", "--json", "r.json", "--baseline", str(baseline), STEPS,
                     "--steps", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "identical to the baseline over 4 steps" in result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["baseline"] == str(baseline) and report["environment_drift"] == []


def test_baseline_detects_a_changed_result(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.h5"
    run_cli("check", "--update-baseline", "--baseline", str(baseline), STEPS, "--steps", "4",
            cwd=tmp_path)
    # another learning rate changes the result (other arguments are refused unless allowed)
    result = run_cli("check", "--json", "r.json", "--allow-script-change", "--baseline",
                     str(baseline), STEPS, "--steps", "4", "--lr", "0.2", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "FAIL" in result.stdout and "step 0" in result.stdout


def test_environment_drift_is_refused_then_allowed(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.h5"
    run_cli("check", "--update-baseline", "--baseline", str(baseline), STEPS, cwd=tmp_path)
    env = {"OMP_NUM_THREADS": "1"}
    refused = run_cli("check", "--baseline", str(baseline), STEPS, cwd=tmp_path, env=env)
    assert refused.returncode == 2
    message = refused.stderr.strip()
    assert "env.OMP_NUM_THREADS (baseline (unset), now 1)" in message
    assert "torch.num_threads (baseline" in message and "--allow-env-drift" in message
    allowed = run_cli("check", "--allow-env-drift", "--json", "r.json", "--baseline",
                      str(baseline), STEPS, cwd=tmp_path, env=env)
    assert allowed.returncode in (0, 1), allowed.stderr
    drift = json.loads((tmp_path / "r.json").read_text())["environment_drift"]
    assert {d["key"] for d in drift} >= {"env.OMP_NUM_THREADS", "torch.num_threads"}


@pytest.mark.parametrize("content", [b"", b"not hdf5 at all"])
def test_bad_baseline_is_exit_2(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "baseline.h5"
    bad.write_bytes(content)
    result = run_cli("check", "--baseline", str(bad), STEPS, cwd=tmp_path)
    assert result.returncode == 2 and "cannot read" in result.stderr


def test_missing_baseline_says_how_to_make_one(tmp_path: Path) -> None:
    result = run_cli("check", "--baseline", "nope.h5", STEPS, cwd=tmp_path)
    assert result.returncode == 2 and "--update-baseline" in result.stderr


def test_update_baseline_needs_a_file() -> None:
    result = run_cli("check", "--update-baseline", STEPS)
    assert result.returncode == 2 and "--update-baseline needs --baseline" in result.stderr


def test_runs_3_shows_more_than_one_outcome(tmp_path: Path) -> None:
    result = run_cli("check", "-v", "--runs", "3", "--json", "r.json", UNSEEDED, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    table = json.loads((tmp_path / "r.json").read_text())["repeatability"]
    assert len(table["runs"]) == 3 and table["distinct_outcomes"] >= 2
    assert "distinct outcomes in 3 runs" in result.stdout


def _doc_blocks(kind: str) -> list[str]:
    text = (REPO / "docs" / "ci.md").read_text()
    return re.findall(rf"```{kind}\n(.*?)```", text, flags=re.S)


def _nondet_commands(text: str) -> list[list[str]]:
    commands = []
    for line in text.splitlines():
        line = line.strip().removeprefix("- ").removeprefix("run: ")
        if line.startswith("nondet "):
            commands.append(shlex.split(line.split("  #")[0]))
    return commands


def test_ci_examples_are_valid_yaml_with_valid_nondet_commands() -> None:
    from nondet.cli import cli

    blocks = _doc_blocks("yaml")
    workflows = [yaml.safe_load(b) for b in blocks]
    github, gitlab, precommit = workflows
    assert "jobs" in github and "steps" in github["jobs"]["nondet"]
    assert gitlab["determinism"]["artifacts"]["reports"]["junit"] == "nondet-junit.xml"
    assert precommit["repos"][0]["hooks"][0]["id"] == "nondet-check"
    commands = [c for b in blocks + _doc_blocks("sh") for c in _nondet_commands(b)]
    assert len(commands) >= 5
    for argv in commands:
        # Parsing is enough: every option and argument must be accepted as written.
        cli.make_context("nondet", argv[1:])
        sub = cli.get_command(None, argv[1])  # type: ignore[arg-type]
        assert sub is not None
        sub.make_context(argv[1], argv[2:])


def test_pre_commit_hook_runs_a_valid_command() -> None:
    from nondet.cli import cli

    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    assert hooks[0]["id"] == "nondet-check" and hooks[0]["pass_filenames"] is False
    entry = shlex.split(hooks[0]["entry"])
    documented = yaml.safe_load(_doc_blocks("yaml")[2])["repos"][0]["hooks"][0]["args"]
    sub = cli.get_command(None, entry[1])  # type: ignore[arg-type]
    assert sub is not None
    sub.make_context(entry[1], [*entry[2:], *map(str, documented)])


# -- exit codes and report files for every outcome ------------------------------------------
def test_internal_error_still_writes_junit_and_json(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from nondet import cli, pipeline

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(pipeline, "diagnose", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["nondet", "check", "--junit", "j.xml", "--json", "r.json",
                                      STEPS])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 3
    error = _junit(tmp_path / "j.xml").find(".//testcase/error")
    assert error is not None and "internal error" in error.get("message")
    assert "simulated bug" in error.get("message")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "error" and report["exit_code"] == 3


def test_unknown_option_is_a_junit_error_too(tmp_path: Path) -> None:
    result = run_cli("check", "--junit", "j.xml", "--bogus-option", STEPS, cwd=tmp_path)
    assert result.returncode == 2 and "no such option: --bogus-option" in result.stderr
    error = _junit(tmp_path / "j.xml").find(".//testcase/error")
    assert error is not None and "no such option" in error.get("message")


def test_update_baseline_under_a_file_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = run_cli("check", "--update-baseline", "--baseline", "file/ci/baseline.h5", STEPS,
                     cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "file is a file, not a directory" in result.stderr


def test_update_baseline_into_a_read_only_directory_is_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root writes into read-only directories: the refusal is exercised through os.access.
    import os
    import sys

    from nondet import cli

    (tmp_path / "ro").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "ro"
                        and real_access(path, mode))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["nondet", "check", "--update-baseline", "--baseline",
                                      "ro/baseline.h5", STEPS])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert not (tmp_path / "ro" / "baseline.h5").exists()


def test_baseline_write_failure_is_a_user_error(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from nondet import baseline
    from nondet.errors import NondetError

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    (tmp_path / "baseline.h5").write_bytes(b"the old baseline")
    (tmp_path / "run.h5").write_bytes(b"new")
    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(NondetError, match="No space left on device"):
        baseline.save(tmp_path / "run.h5", tmp_path / "baseline.h5")
    assert (tmp_path / "baseline.h5").read_bytes() == b"the old baseline"


def test_baseline_kept_inside_out_survives_and_is_used(tmp_path: Path) -> None:
    made = run_cli("check", "--update-baseline", "--baseline", ".nondet/run-baseline.h5", STEPS,
                   "--steps", "2", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    result = run_cli("check", "--baseline", ".nondet/run-baseline.h5", STEPS, "--steps", "2",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "identical to the baseline" in result.stdout
    assert open_capture(tmp_path / ".nondet" / "run-baseline.h5").n_steps == 2


def test_baseline_of_a_different_script_is_refused(tmp_path: Path) -> None:
    run_cli("check", "--update-baseline", "--baseline", "b.h5", STEPS, "--steps", "2",
            cwd=tmp_path)
    other = tmp_path / "train.py"
    other.write_text(Path(STEPS).read_text() + "\n# edited\n")
    refused = run_cli("check", "--junit", "j.xml", "--baseline", "b.h5", str(other), "--steps",
                      "2", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "is of a different script" in refused.stderr and "steps.py" in refused.stderr
    assert _junit(tmp_path / "j.xml").find(".//testcase/error") is not None
    allowed = run_cli("check", "--allow-script-change", "--baseline", "b.h5", str(other),
                      "--steps", "2", cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr


def test_baseline_made_with_other_script_arguments_is_refused(tmp_path: Path) -> None:
    """Other arguments train another model: compared step by step it was "nondeterministic
    at step 0" with an unrelated cause (found with pytorch/examples' reinforce.py and
    ``--gamma 0.98``)."""
    run_cli("check", "--update-baseline", "--baseline", "b.h5", STEPS, "--steps", "2",
            cwd=tmp_path)
    refused = run_cli("check", "--baseline", "b.h5", STEPS, "--steps", "3", cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "ran the script with other arguments: it was made with the arguments --steps 2, " \
        "this check runs --steps 3" in refused.stderr
    allowed = run_cli("check", "--allow-script-change", "--baseline", "b.h5", STEPS,
                      "--steps", "3", cwd=tmp_path)
    assert allowed.returncode in (0, 1), allowed.stderr  # compared, as asked


def test_a_command_line_that_does_not_parse_still_writes_junit(tmp_path: Path) -> None:
    result = run_cli("check", "--junit", "j.xml", "--seed", "-1", STEPS, cwd=tmp_path)
    assert result.returncode == 2 and "--seed" in result.stderr
    error = _junit(tmp_path / "j.xml").find(".//testcase/error")
    assert error is not None and "--seed" in error.get("message")


@pytest.mark.parametrize("allow", [[], ["--allow-env-drift"]])
def test_a_baseline_from_another_fingerprint_scheme_is_written_again(
        tmp_path: Path, allow: list[str]) -> None:
    """A baseline written before the fingerprint definition changed holds values nothing
    today computes: comparing it would call every step different. It was refused as
    environment drift, with --allow-env-drift offered, which then failed on the schemes:
    it is refused before the run, saying to write it again."""
    rows = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "params_fp": 3})
    base = write_capture(tmp_path / "base.h5", rows,
                         env={"fingerprint_scheme": "1", "nondet_version": "0.1.0"})
    result = run_cli("check", "--baseline", str(base), *allow, STEPS, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [x for x in result.stderr.splitlines() if x.startswith("nondet: error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "fingerprint scheme 1 (nondet 0.1.0)" in errors[0]
    assert "--update-baseline" in errors[0]
    assert "--allow-env-drift" not in result.stderr
    assert not list(tmp_path.rglob("run-a.h5"))  # refused before running the script


@pytest.mark.e2e
def test_a_baseline_of_another_framework_says_so_first(tmp_path: Path) -> None:
    """Faults round 9: a TensorFlow script's baseline given to a torch script's check
    (with --allow-script-change) listed 1,500 characters of environment drift ending in
    "--allow-env-drift", which then said the captures could not be compared."""
    tf_script = str(REPO / "fixtures" / "tensorflow" / "custom_loop_control.py")
    made = run_cli("check", "--update-baseline", "--baseline", "tf.h5", tf_script,
                   cwd=tmp_path, timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    result = run_cli("check", "--baseline", "tf.h5", "--allow-script-change", STEPS,
                     cwd=tmp_path, timeout=600)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [x for x in result.stderr.splitlines() if x.startswith("nondet: error")]
    assert len(errors) == 1 and "nothing in them can be compared" in errors[0], result.stderr
    assert "--allow-env-drift" not in result.stderr
