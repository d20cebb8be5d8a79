"""Fixes applied from outside: the table, the recipes that name them, the child side, the
CLI (`nondet fixes`, `--apply`), and the verification logic on synthetic captures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nondet import interventions, recipe, verify
from nondet.launch import Plan, RunResult
from nondet.store import open_capture
from tests.conftest import REPO, run_cli, step_rows, write_capture


def test_every_recipe_names_known_interventions() -> None:
    named = [(r.id, i) for r in recipe.load() for i in r.apply]
    assert named, "no recipe says how its fix is applied from outside"
    unknown = [(rid, i) for rid, i in named if i not in interventions.TABLE]
    assert not unknown, unknown


@pytest.mark.parametrize(("recipe_id", "first"), [
    ("PT-GETITEM-CPU", "torch.deterministic"),
    ("DATA-PT-INORDER", "torch.dataloader_in_order"),
    ("TF-DATA-OPTIONS", "tf.data_deterministic"),
    ("TF-DATA-STAGE-ORDER", "tf.data_deterministic"),
    ("TF-BIASADDGRAD", "tf.op_determinism"),
    ("PY-SEED-VARIES", "seeding.pin_seeds"),
    ("DATA-PT-WORKER-SEED-VARIES", "seeding.pin_seeds"),
    ("KERAS-PYDATASET-WORKERS", "keras.pydataset_one_worker"),
])
def test_recipes_say_how_their_fix_is_applied(recipe_id: str, first: str) -> None:
    by_id = {r.id: r for r in recipe.load()}
    assert by_id[recipe_id].apply[0] == first
    assert by_id["TF-TF32"].apply == ()  # a code change only


def test_every_switch_and_patch_has_a_child_function() -> None:
    for item in interventions.TABLE.values():
        assert item.how in ("env", "switch", "patch"), item.id
        if item.how == "env":
            assert item.env and item.id not in interventions._CHILD, item.id
        else:
            assert item.id in interventions._CHILD and not item.env, item.id


def test_environment_sets_variables_and_the_child_list() -> None:
    env = interventions.environment(["env.omp_one_thread", "torch.deterministic",
                                     "torch.dataloader_in_order"])
    assert env == {"OMP_NUM_THREADS": "1",
                   interventions.APPLY_ENV: "torch.deterministic,torch.dataloader_in_order"}
    assert interventions.environment(["env.cublas_workspace"]) == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


_CHILD_PROBE = """
import sys
from nondet import interventions
print(interventions.apply_requested(7))
import numpy as np, torch
from torch.utils.data import DataLoader
print(torch.are_deterministic_algorithms_enabled())
print(DataLoader(list(range(8)), batch_size=2, in_order=False).in_order)
print(np.random.default_rng().integers(0, 2**62), np.random.default_rng().integers(0, 2**62))
print(np.random.default_rng(3).integers(0, 2**62))
"""


def _child(apply: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), interventions.APPLY_ENV: apply}
    out = subprocess.run([sys.executable, "-c", _CHILD_PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.splitlines()


def test_child_applies_switches_and_patches() -> None:
    pytest.importorskip("torch")
    applied = "torch.deterministic,torch.dataloader_in_order,numpy.seed_unseeded_generators"
    first, second = _child(applied), _child(applied)
    assert first[0] == str(applied.split(","))
    assert first[1:3] == ["True", "True"]
    draws = first[3].split()
    assert draws == second[3].split() and draws[0] != draws[1]  # seeded, each its own stream
    assert first[4] == second[4] == str(np.random.default_rng(3).integers(0, 2**62))
    plain = _child("")
    assert plain[0] == "[]" and plain[1:3] == ["False", "False"]


_TF_PROBE = """
from nondet import interventions
print(interventions.apply_requested(7))
import tensorflow as tf
print(tf.random.Generator.from_non_deterministic_state().normal([2]).numpy().tolist())
print(tf.random.Generator.from_non_deterministic_state().normal([2]).numpy().tolist())
print(tf.random.get_global_generator().normal([2]).numpy().tolist())
"""


def _probe_child(probe: str, apply: str) -> list[str]:
    """The last 4 lines a TensorFlow probe prints in a process of its own, with the
    interventions ``apply`` requested as a run requests them."""
    env = {**os.environ, "PYTHONPATH": str(REPO), interventions.APPLY_ENV: apply,
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.splitlines()[-4:]


def test_tf_generators_from_the_os_are_seeded_by_their_patch() -> None:
    pytest.importorskip("tensorflow")

    def child(apply: str) -> list[str]:
        return _probe_child(_TF_PROBE, apply)

    first, second = child("tf.generator_from_seed"), child("tf.generator_from_seed")
    assert first[0] == "['tf.generator_from_seed']"
    assert first[1:] == second[1:]  # the same streams in two processes
    assert len(set(first[1:])) == 3  # each generator its own stream
    plain = child("")
    assert plain[0] == "[]" and plain[1] != first[1] and plain[1:] != child("")[1:]


_TF_STAGES = """
import tensorflow as tf
from nondet import interventions
interventions.apply_requested(0)
ds = tf.data.Dataset.range(4)
print(ds.map(lambda x: x, 2, False)._deterministic)  # by position
print(ds.map(lambda x: x, num_parallel_calls=2, deterministic=False)._deterministic)
print(ds.batch(2, num_parallel_calls=2, deterministic=False)._deterministic)
print(ds.map(lambda x: x, num_parallel_calls=2)._deterministic)  # unset stays unset
"""


def test_tf_stages_given_deterministic_false_are_put_in_order_by_their_patch() -> None:
    pytest.importorskip("tensorflow")
    assert _probe_child(_TF_STAGES, "tf.data_deterministic") == [
        "true", "true", "true", "default"]
    assert _probe_child(_TF_STAGES, "") == ["false", "false", "false", "default"]


def test_a_failing_intervention_is_one_line_and_the_script_runs_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(_seed: int) -> None:
        raise RuntimeError("no such backend")

    monkeypatch.setitem(interventions._CHILD, "torch.one_thread", broken)
    monkeypatch.setenv(interventions.APPLY_ENV, "torch.one_thread,bogus")
    assert interventions.apply_requested() == []
    err = capsys.readouterr().err.splitlines()
    assert err == ["nondet: could not apply torch.one_thread: RuntimeError: no such backend",
                   "nondet: no intervention named bogus"]


def test_fixes_lists_every_intervention() -> None:
    result = run_cli("fixes")
    assert result.returncode == 0, result.stderr
    for item in interventions.TABLE.values():
        assert any(line.startswith(item.id + " ") and item.does in line
                   for line in result.stdout.splitlines()), item.id


@pytest.mark.parametrize("command", ["run", "check"])
def test_unknown_fix_is_a_usage_error(command: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = run_cli(command, "--apply", "torch.nope", "--out", str(tmp_path / "out"),
                     str(script))
    assert result.returncode == 2
    assert "no fix named torch.nope; `nondet fixes` lists" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


# -- verification on synthetic captures ----------------------------------------------------
def _steps(params: list[int], wall_step: float) -> np.ndarray:
    return step_rows(*({"step": i, "params_fp": p, "wall": (i + 1) * wall_step}
                       for i, p in enumerate(params)))


def _suggestions(*ids: str) -> list[recipe.Suggestion]:
    by_id = {r.id: r for r in recipe.load()}
    return [recipe.Suggestion(by_id[i], by_id[i].fix, by_id[i].fix_kind, "", True)
            for i in ids]


def _pair(tmp_path: Path, a: list[int], b: list[int], wall: float = 1.0) -> tuple[Path, Path]:
    return (write_capture(tmp_path / f"a{len(list(tmp_path.iterdir()))}.h5", _steps(a, wall)),
            write_capture(tmp_path / f"b{len(list(tmp_path.iterdir()))}.h5", _steps(b, wall)))


def _results(pa: Path, pb: Path, log: str = "") -> tuple[RunResult, RunResult]:
    results = []
    for p in (pa, pb):
        p.with_suffix(".log").write_text(log)
        results.append(RunResult(p.stem, p, p.with_suffix(".log"), "complete", 0, 3))
    return results[0], results[1]


def test_the_fix_under_which_the_runs_repeat_is_verified_and_ranks_first(
        tmp_path: Path) -> None:
    first = tuple(open_capture(p) for p in _pair(tmp_path, [1, 2, 3], [1, 5, 6]))
    tried: list[tuple[str, ...]] = []

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        tried.append(ids)
        assert plans[0].stop_after == 2 and plans[0].op_steps == [-1, 0]  # as the first pair
        # torch.one_thread repeats (at 1.5x the step time); anything else still parts
        pa, pb = (_pair(tmp_path, [1, 2, 3], [1, 2, 3], wall=1.5) if ids == ("torch.one_thread",)
                  else _pair(tmp_path, [1, 2, 3], [1, 2, 4]))
        return _results(pa, pb)

    ordered, written = verify.verify(_suggestions("PT-GETITEM-CPU", "PY-FS-ORDER",
                                                  "PT-CPU-THREADS", "DATA-PT-INORDER"),
                                     first, run_pair, lambda _text: None, [-1, 0])
    assert tried == [("torch.deterministic",), ("torch.deterministic_warn_only",),
                     ("torch.one_thread",)]
    assert [s.recipe.id for s in ordered] == ["PT-CPU-THREADS", "PT-GETITEM-CPU",
                                             "PY-FS-ORDER", "DATA-PT-INORDER"]
    won, failed, code, untried = ordered
    assert (won.verified, won.verified_steps, won.cost_ratio) == (True, 3, 1.5)
    assert failed.verified is False and "did not help" in failed.verify_note
    assert code.verified is None and "code change" in code.verify_note
    assert untried.verified is None  # an earlier fix was verified: not tried
    assert len(written) == 6


def test_a_fix_that_makes_the_script_fail_is_reported_and_the_next_is_tried(
        tmp_path: Path) -> None:
    from nondet.errors import ScriptFailed

    first = tuple(open_capture(p) for p in _pair(tmp_path, [1, 2], [1, 3]))

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        if ids == ("torch.deterministic",):
            raise ScriptFailed("the script failed in run a-fix1 (exit code 1): RuntimeError: "
                               "index_put has no deterministic implementation; its output is "
                               "in x.log")
        pa, pb = _pair(tmp_path, [1, 2], [1, 2])
        return _results(pa, pb)

    (only,), _ = verify.verify(_suggestions("PT-GETITEM-CPU"), first, run_pair,
                               lambda _text: None)
    assert only.verified is True and "warn_only=True" in only.verify_note
    assert "failed with it (the script failed in run a-fix1 (exit code 1): RuntimeError: " \
        "index_put has no deterministic implementation)" in only.verify_note


def test_nothing_is_verified_when_the_step_rows_never_parted(tmp_path: Path) -> None:
    first = tuple(open_capture(p) for p in _pair(tmp_path, [1, 2], [1, 2]))

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        raise AssertionError("no verification runs: nothing could show a fix working")

    (only,), written = verify.verify(_suggestions("PT-GETITEM-CPU"), first, run_pair,
                                     lambda _text: None)
    assert only.verified is None and written == []


def test_step_time_skips_op_captured_steps() -> None:
    rows = step_rows({"step": 0, "wall": 10.0, "n_records": 50}, {"step": 1, "wall": 11.0},
                     {"step": 2, "wall": 12.0}, {"step": 3, "wall": 13.0})
    assert verify.step_time(rows) == 1.0


def test_a_fix_the_child_could_not_apply_is_neither_verified_nor_refuted(
        tmp_path: Path) -> None:
    first = tuple(open_capture(p) for p in _pair(tmp_path, [1, 2], [1, 3]))

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        # the switch failed in the child, the script ran on unchanged (and repeated by luck)
        pa, pb = _pair(tmp_path, [1, 2], [1, 2])
        return _results(pa, pb, f"{interventions.NOT_APPLIED} {ids[0]}: ImportError: no tf\n")

    (only,), _ = verify.verify(_suggestions("TF-BIASADDGRAD"), first, run_pair,
                               lambda _text: None)
    assert only.verified is None
    assert "could not be applied from outside (ImportError: no tf)" in only.verify_note


def test_at_most_max_tries_pairs_are_run(tmp_path: Path) -> None:
    first = tuple(open_capture(p) for p in _pair(tmp_path, [1, 2], [1, 3]))
    tried: list[tuple[str, ...]] = []

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        tried.append(ids)
        return _results(*_pair(tmp_path, [1, 2], [1, 4]))

    ordered, _ = verify.verify(_suggestions("PT-GETITEM-CPU", "PT-CPU-THREADS",
                                            "LIB-OMP-THREADS-DIFF", "DATA-PT-INORDER"),
                               first, run_pair, lambda _text: None)
    assert len(tried) == verify.MAX_TRIES
    assert "not tried (at most" in ordered[-1].verify_note


def test_the_text_report_marks_the_verified_fix_with_its_cost() -> None:
    from nondet.report import text

    won, lost, code = _suggestions("PT-GETITEM-CPU", "PT-CPU-THREADS", "PY-ENTROPY")
    won.verified, won.verified_steps, won.cost_ratio = True, 4, 1.07
    won.verify_note = "verified with torch.use_deterministic_algorithms(True): the runs repeat"
    lost.verified, lost.verify_note = False, "torch.set_num_threads(1): did not help"
    code.verify_note = "a code change: cannot be applied from outside"
    assert text._verification(won) == ("verified: with torch.use_deterministic_algorithms(True)"
                                       ": the runs repeat; cost 1.07x step time")
    assert text._verification(lost) == "not verified: torch.set_num_threads(1): did not help"
    assert text._verification(code) == "a code change: cannot be applied from outside"


def test_stable_tensor_hash_makes_a_set_of_tensors_iterate_alike_at_other_addresses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PY-TENSOR-SET-ORDER's verification: a set of tensors iterates by id() (memory
    address: another order in another run); patched, by the order they were first hashed."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.Tensor, "__hash__", torch.Tensor.__hash__)  # restored after
    interventions._torch_stable_tensor_hash(0)
    kept = []

    def order_in_a_set(spacing: int) -> list[int]:
        made = []
        for i in range(40):
            made.append(torch.nn.Parameter(torch.zeros(1)))
            kept.append(torch.zeros(1 + spacing * i % 5))  # other addresses for the next
        index = {id(t): i for i, t in enumerate(made)}
        return [index[id(t)] for t in set(made)]

    assert order_in_a_set(1) == order_in_a_set(3)
    made = [torch.zeros(1) for _ in range(3)]
    assert made[1] in set(made) and torch.zeros(1) not in set(made)


def test_step_time_is_the_shortest_step_a_busy_machine_slowed_the_others() -> None:
    """Trial: the first pair's growth steps shared the machine with the narrowing runs
    starting up beside them: the median made a fix read as costing 0.18-0.56x."""
    rows = step_rows({"step": 0, "wall": 1.0}, {"step": 1, "wall": 1.3},
                     {"step": 2, "wall": 1.4}, {"step": 3, "wall": 1.7},
                     {"step": 4, "wall": 2.0})
    assert verify.step_time(rows) == pytest.approx(0.1)


_PY_RANDOM_PROBE = """
import random
from nondet import interventions
print(interventions.apply_requested(7))
a, b = random.Random(), random.Random()
print(a.random(), b.random())
random.seed()
print(random.random())
print(random.Random(3).random())
"""


def test_python_random_made_without_a_seed_gets_one() -> None:
    """Trial: an unseeded random.Random() (PY-ENTROPY) had no fix nondet could apply, where
    NumPy's unseeded generators did."""
    first, second = (_probe_child(_PY_RANDOM_PROBE, "python.seed_unseeded_random")
                     for _ in range(2))
    assert first == second  # the same streams in two processes
    draws = first[1].split()
    assert draws[0] != draws[1]  # each generator its own stream
    assert first[3] == str(__import__("random").Random(3).random())  # a given seed is kept
    plain = [_probe_child(_PY_RANDOM_PROBE, "")[1] for _ in range(2)]
    assert plain[0] != plain[1]  # without it: fresh entropy each time


_NP_SEED_PROBE = """
import numpy as np
from nondet import interventions
print(interventions.apply_requested(7))
np.random.seed()
a = np.random.random()
np.random.seed(None)
print(a, np.random.random())
np.random.seed(3)
print(np.random.random())
print(np.random.default_rng().random())
"""


def test_numpys_global_generator_reseeded_without_a_seed_gets_one() -> None:
    """Trial (normflows, round 12): ``np.random.seed(None)`` reseeds the legacy global
    generator from fresh entropy; no fix nondet could apply reached it."""
    first, second = (_probe_child(_NP_SEED_PROBE, "numpy.seed_unseeded_generators")
                     for _ in range(2))
    assert first == second  # the same streams in two processes
    draws = first[1].split()
    assert draws[0] != draws[1]  # each reseeding its own stream
    np.random.seed(3)
    assert first[2] == str(np.random.random())  # a given seed is kept
    plain = [_probe_child(_NP_SEED_PROBE, "")[1] for _ in range(2)]
    assert plain[0] != plain[1]  # without it: fresh entropy each time


_INTEROP = """
import torch
from nondet import interventions
interventions.apply_requested(0)
torch.set_num_interop_threads(2)  # the script's own call: after nondet's it would fail
print(torch.get_num_interop_threads())
"""


def test_one_interop_thread_holds_against_the_scripts_own_call() -> None:
    """PyTorch round 15: a TorchScript ensemble forking its heads (torch.jit.fork) set
    two inter-op threads itself; the fix nondet tried failed the script (the count may be
    set once), so nothing verified set_num_interop_threads(1)."""
    pytest.importorskip("torch")
    assert _probe_child(_INTEROP, "torch.one_interop_thread") == ["1"]
    assert _probe_child(_INTEROP, "") == ["2"]


def test_a_fix_nondet_cannot_apply_is_named_by_its_kind(tmp_path: Path) -> None:
    """Trial round 17: LIB-MKL's fix is an environment variable (``MKL_CBWR=AUTO``), yet
    its note said "a code change"; PT-HOGWILD's is advice."""
    first = tuple(open_capture(p) for p in _pair(tmp_path, [1, 2], [1, 3]))

    def run_pair(plans: tuple[Plan, Plan], ids: tuple[str, ...]) -> tuple[RunResult, RunResult]:
        raise AssertionError("nothing here can be applied from outside")

    env, advice, code = verify.verify(_suggestions("LIB-MKL", "PT-HOGWILD", "PT-PUT"), first,
                                      run_pair, lambda _text: None)[0]
    assert env.verify_note.startswith("an environment setting nondet has no switch for")
    assert advice.verify_note.startswith("advice, not a change nondet can make")
    assert code.verify_note == "a code change: cannot be applied from outside"
