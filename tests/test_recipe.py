"""The recipe table: complete, well-formed, and matching the findings it is meant for."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

import pytest

from nondet import recipe

IDS_FROM_RECIPE_MD = (Path(__file__).parent / "data" / "recipe_ids.txt").read_text().split()


def _raw_entries() -> list[dict]:
    entries = []
    for name in ("torch.toml", "tensorflow.toml"):
        text = (resources.files("nondet") / "recipes" / name).read_text(encoding="utf-8")
        entries += tomllib.loads(text)["recipe"]
    return entries


def test_every_cause_in_recipe_md_has_an_entry() -> None:
    ids = {r.id for r in recipe.load()}
    missing = sorted(set(IDS_FROM_RECIPE_MD) - ids)
    assert not missing, f"RECIPE.md causes without a recipe entry: {missing}"


def test_entries_are_well_formed() -> None:
    entries = _raw_entries()
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids)), "recipe ids must be unique"
    for e in entries:
        for key in ("id", "framework", "title", "cause", "fix", "fix_kind", "applies",
                    "sources", "match"):
            assert key in e, f"{e.get('id')}: missing {key}"
        assert e["framework"] in ("torch", "tensorflow", "any"), e["id"]
        assert e["fix_kind"] in ("code", "env", "advice"), e["id"]
        assert "\n" not in e["fix"] and e["fix"].strip(), f"{e['id']}: fix must be one line"
        assert e["sources"] and all(s.startswith("https://") for s in e["sources"]), e["id"]
        assert e["match"], f"{e['id']}: an empty match would match every finding"
        for variant in e.get("variants", []):
            assert "\n" not in variant["fix"], e["id"]
        if e["applies"]:
            assert recipe.version_satisfies(e["applies"], {}) is None, e["id"]


@pytest.mark.parametrize(("spec", "installed", "expected"), [
    ("torch>=1.8", "2.13.0+cpu", True),
    ("torch>=2.14", "2.13.0+cpu", False),
    ("torch>=1.11,<1.13", "1.12.1", True),
    ("torch>=1.11,<1.13", "1.13.0", False),
    ("tensorflow>=2.1,<2.8", "2.7.4", True),
    ("tensorflow>=2.8", "2.21.0", True),
    ("", "anything", True),
])
def test_version_specifiers(spec: str, installed: str, expected: bool) -> None:
    package = spec.split(">")[0].split("<")[0] if spec else "torch"
    assert recipe.version_satisfies(spec, {f"{package}_version": installed}) is expected


def test_unknown_installed_version_is_unknown_not_false() -> None:
    assert recipe.version_satisfies("torch>=1.8", {}) is None


def _ids(**facts: object) -> list[str]:
    base = {"framework": "torch", "torch_version": "2.13.0", "kind": "op"}
    return [s.recipe.id for s in recipe.suggest({**base, **facts}, limit=10)]


def test_cpu_advanced_indexing_backward() -> None:
    ids = _ids(op="aten.index_put.default", device="cpu", phase="backward")
    # The entry that names op, device and phase beats the one that names only the op.
    assert ids[:2] == ["PT-GETITEM-CPU", "PT-INDEXPUT"]
    assert _ids(op="aten.index_put_.default", device="cpu", phase="forward")[0] == "PT-INDEXPUT"
    first = recipe.suggest({"framework": "torch", "torch_version": "2.13.0", "kind": "op",
                            "op": "aten.index_put.default", "device": "cpu",
                            "phase": "backward"})[0]
    assert first.fix == "torch.use_deterministic_algorithms(True)" and first.applies_here


@pytest.mark.parametrize(("device", "accumulates", "first"), [
    ("cpu", True, "PT-PUT-CPU"), ("cpu", False, "PT-PUT"), ("cuda", False, "PT-PUT"),
    ("cuda", True, "PT-PUT-CUDA")])
def test_put_gets_the_fix_for_how_it_was_called(device: str, accumulates: bool,
                                                first: str) -> None:
    """PyTorch round 16: ``put_`` overwriting repeated indices (accumulate=False) got the
    accumulate=True recipe first (the flag, under which it raises), and PT-PUT's code line
    turned the overwrite into a sum. How the op was called is now a recorded fact."""
    ids = _ids(op="aten.put_.default", device=device, phase="forward",
               **{"op.accumulates": accumulates})
    assert ids[0] == first, ids
    fix = recipe.suggest({"framework": "torch", "torch_version": "2.13.0", "kind": "op",
                          "op": "aten.put_.default", "device": device,
                          "op.accumulates": accumulates})[0].fix
    assert ("accumulate=True" in fix) == (accumulates and device == "cuda"), fix


def test_a_loaded_tensor_that_differs_points_at_what_wrote_the_file() -> None:
    # a checkpoint written by an unseeded subprocess stage, read with torch.load: the first
    # fix was "[PY-THIRDPARTY-RNG] cv2.setRNGSeed(...) in the DataLoader worker_init_fn"
    ids = _ids(kind="entry", entry_kind="external", phase="init",
               op="tensor from a storage (aten.set_)")
    assert ids[0] == "PT-LOADED-FILE", ids
    other = _ids(kind="entry", entry_kind="external", phase="forward", op="parameter w")
    assert "PT-LOADED-FILE" not in other


def test_dataloader_out_of_order() -> None:
    ids = _ids(kind="entry", entry_kind="dataloader", phase="data", op="batch",
               **{"loader.in_order": False, "loader.num_workers": 2})
    assert ids[0] == "DATA-PT-INORDER"
    in_order = _ids(kind="entry", entry_kind="dataloader", phase="data", op="batch",
                    **{"loader.in_order": True, "loader.num_workers": 2})
    assert "DATA-PT-INORDER" not in in_order


def test_unseeded_numpy_generator() -> None:
    assert _ids(kind="entry", entry_kind="numpy", phase="forward", op="torch.from_numpy",
                **{"numpy.unseeded_generator": True})[0] == "PY-NP-GENERATOR"


def test_a_seed_that_varies_in_dataloader_workers_gets_the_workers_own_seed() -> None:
    # a constant (PY-SEED-VARIES) repeats, but gives every worker the same stream
    worker = _ids(kind="seed", phase="other", op="np.random.seed", framework="torch",
                  **{"seed.in_loader_worker": True})
    assert worker[:2] == ["DATA-PT-WORKER-SEED-VARIES", "PY-SEED-VARIES"]
    main = _ids(kind="seed", phase="init", op="np.random.seed", framework="torch",
                **{"seed.in_loader_worker": False})
    assert main[0] == "PY-SEED-VARIES" and "DATA-PT-WORKER-SEED-VARIES" not in main


def test_custom_op_and_uninitialized_reads_and_rng() -> None:
    assert _ids(op="fixtures.racy_sum.default", device="cpu", custom_op=True)[0] == "CUSTOM-OP"
    assert _ids(op="aten.add.Tensor", device="cpu", reads_uninitialized=True)[0] == "PT-UNINIT"
    assert _ids(op="aten.uniform_.default", device="cpu", rng_op=True)[0] == "PT-RNG"


def test_a_generator_seeded_from_the_os_gets_from_seed_verified_by_a_patch() -> None:
    # h-realtf2: `tf.random.Generator.from_non_deterministic_state()` was answered with
    # set_global_generator (which leaves that generator unseeded) and no way to verify it
    facts = {"framework": "tensorflow", "tensorflow_version": "2.21.0", "kind": "op",
             "op": "NonDeterministicInts", "device": "cpu", "phase": "forward",
             "tf.intra_op_threads": 0}
    first = recipe.suggest(facts)[0]
    assert first.recipe.id == "TF-GENERATOR-NONDET"
    assert "from_seed" in first.fix and first.recipe.apply == ("tf.generator_from_seed",)
    state = _ids(kind="entry", entry_kind="rng_state", framework="tensorflow", op="v")
    assert state[0] == "TF-GENERATOR-STATE"  # a differing state variable keeps its entry


def test_tensorflow_fix_follows_the_installed_version() -> None:
    def fix_for(version: str) -> str:
        facts = {"framework": "tensorflow", "tensorflow_version": version, "kind": "op",
                 "op": "BiasAddGrad", "device": "gpu", "phase": "backward"}
        return recipe.suggest(facts)[0].fix

    assert "enable_op_determinism" in fix_for("2.21.0")
    assert "TF_DETERMINISTIC_OPS=1" in fix_for("2.6.0")
    old = fix_for("1.15.0")  # TF 1.14-2.0: TF_CUDNN_DETERMINISTIC plus the fwr13y bias_add patch
    assert "fwr13y" in old or "TF_CUDNN_DETERMINISTIC=1" in old


def test_a_collective_finding_gets_the_recipes_of_its_recorded_backend() -> None:
    """Chosen by what the capture recorded of the call (collective.call_info facts)."""
    nccl = _ids(kind="collective", phase="comm", op="c10d.allreduce_.default",
                device="cuda", **{"comm.backend": "nccl", "comm.ddp_bucket": True})
    assert nccl[:3] == ["DIST-NCCL-ALGO", "DIST-NCCL-PROTO", "DIST-PT-DDP-BUCKET"]
    first = recipe.suggest({"framework": "torch", "kind": "collective", "phase": "comm",
                            "op": "c10d.allreduce_.default", "comm.backend": "nccl"})[0]
    assert first.fix == "NCCL_ALGO=Ring" and first.recipe.apply[0] == "nccl.algo_ring"
    gloo = _ids(kind="collective", phase="comm", op="c10d.allreduce_.default", device="cpu",
                **{"comm.backend": "gloo", "comm.ddp_bucket": True})
    assert gloo[0] == "DIST-PT-DDP-BUCKET" and not {"DIST-NCCL-ALGO", "DIST-NCCL-PROTO"} & set(gloo)
    anysource = _ids(kind="collective", phase="comm", op="c10d.recv_any_source_.default",
                     device="cpu", **{"comm.backend": "gloo", "comm.ddp_bucket": False})
    assert anysource[0] == "PT-COMM-ANY-SOURCE"


def test_the_nccl_fixes_are_environment_for_every_rank() -> None:
    from nondet import interventions

    assert interventions.environment(["nccl.ring_simple"]) == {"NCCL_ALGO": "Ring",
                                                               "NCCL_PROTO": "Simple"}
    assert interventions.environment(["nccl.algo_ring"]) == {"NCCL_ALGO": "Ring"}


def test_a_shared_table_entering_a_child_process_is_hogwild() -> None:
    # hog_embed trial (h-realtorch3): a table updated with index_add_ by two forked workers
    # entered child#0 changed; the first fix was "[PY-THIRDPARTY-RNG] cv2.setRNGSeed(...)"
    ids = _ids(kind="entry", entry_kind="external", phase="optimizer",
               op="tensor float32[500, 256]", child_process=True)
    assert ids[0] == "PT-HOGWILD", ids
    main = _ids(kind="entry", entry_kind="external", phase="optimizer",
                op="tensor float32[500, 256]", child_process=False)
    assert "PT-HOGWILD" not in main
    loaded = _ids(kind="entry", entry_kind="external", phase="init",
                  op="tensor from a storage (aten.set_)", child_process=True)
    assert loaded[0] == "PT-LOADED-FILE", loaded


def test_an_optimizer_given_a_set_explains_an_op_whose_inputs_came_in_another_order() -> None:
    facts = {"torch.optimizer_params_set": True}
    assert _ids(op="aten._foreach_norm.Scalar", device="cpu", phase="optimizer",
                explained=False, **facts)[0] == "PY-TENSOR-SET-ORDER"
    # a race found by the injection rule (inputs equal) keeps its own cause
    assert "PY-TENSOR-SET-ORDER" not in _ids(op="aten._foreach_norm.Scalar", device="cpu",
                                             phase="optimizer", explained=True, **facts)


def test_a_tensorflow_entry_gets_no_torch_worker_fix() -> None:
    # Trial (keras-io custom loop with an unseeded NumPy draw): "also [PY-THIRDPARTY-RNG]
    # cv2.setRNGSeed(torch.initial_seed() ...) inside worker_init_fn" in a TensorFlow report
    facts = {"framework": "tensorflow", "kind": "entry", "entry_kind": "external",
             "tensorflow_version": "2.21.0"}
    assert "PY-THIRDPARTY-RNG" not in [s.recipe.id for s in recipe.suggest(facts, limit=9)]
    torch_facts = {**facts, "framework": "torch", "torch_version": "2.13.0"}
    assert "PY-THIRDPARTY-RNG" in [s.recipe.id for s in recipe.suggest(torch_facts, limit=9)]


def test_parameter_server_advice_needs_a_parameter_server() -> None:
    """Trials: TF-SESSION-PS ("tf.compat.v1.Session / ParameterServerStrategy") was offered
    for any TensorFlow op of the optimizer phase: the cause `nondet diff` gave a racy
    PyFunc's captures, and an "also" under a MirroredStrategy."""
    facts = {"framework": "tensorflow", "kind": "op", "phase": "optimizer", "op": "AddN",
             "tensorflow_version": "2.21.0", "tf.distribute.strategy": True}
    assert "TF-SESSION-PS" not in [s.recipe.id for s in recipe.suggest(facts, limit=9)]
    with_ps = {**facts, "tf.distribute.parameter_server": True}
    assert "TF-SESSION-PS" in [s.recipe.id for s in recipe.suggest(with_ps, limit=9)]


def test_a_value_from_the_clock_is_its_own_cause() -> None:
    """Trial: replay-buffer noise, a normalizer and BatchNorm statistics fed from
    ``time.perf_counter_ns()`` (at the entry's own line) got "[PY-THIRDPARTY-RNG]
    cv2.setRNGSeed(...)" first."""
    facts = {"framework": "torch", "kind": "entry", "entry_kind": "python_value",
             "phase": "forward", "torch_version": "2.13.0", "entry.reads_clock": True}
    assert recipe.suggest(facts, limit=3)[0].recipe.id == "PY-CLOCK-VALUE"
    assert "PY-CLOCK-VALUE" not in [s.recipe.id for s in recipe.suggest(
        {**facts, "entry.reads_clock": False}, limit=9)]


def test_the_clock_is_read_at_lines_that_call_it() -> None:
    from nondet.analysis import _READS_CLOCK

    assert _READS_CLOCK.search("jitter = torch.full((4, 8), time.perf_counter_ns() % 1000)")
    assert _READS_CLOCK.search("stamp = datetime.now().timestamp()")
    assert not _READS_CLOCK.search("elapsed = end_time - start_time")


def test_least_squares_on_the_cpu_gets_its_own_entry_with_a_switch_to_verify() -> None:
    """PyTorch round 14: ``torch.linalg.lstsq`` (gelsy) got PT-UNKNOWN-OP, "a code change:
    cannot be applied from outside", though the deterministic switch makes it repeat."""
    first = recipe.suggest({"framework": "torch", "torch_version": "2.13.0", "kind": "op",
                            "op": "aten.linalg_lstsq.default", "device": "cpu",
                            "phase": "forward"})[0]
    assert first.recipe.id == "PT-LSTSQ" and first.recipe.apply == ("torch.deterministic",)


@pytest.mark.parametrize(("fact", "expected"), [("numpy.unseeded_generator", "PY-NP-GENERATOR"),
                                                ("python.unseeded_random", "PY-ENTROPY")])
def test_an_unseeded_generator_drawn_in_a_python_op_is_the_cause(fact: str,
                                                                 expected: str) -> None:
    """TensorFlow round 11: ``np.random.default_rng()`` inside a ``tf.numpy_function`` of a
    traced step got TF-CUSTOM-OP ("reductions in thread-completion order")."""
    base = {"framework": "tensorflow", "tensorflow_version": "2.21.0", "kind": "op",
            "op": "PyFunc", "device": "cpu", "phase": "forward"}
    ids = [s.recipe.id for s in recipe.suggest({**base, fact: True}, limit=5)]
    assert ids[0] == expected, ids
    assert next(s.recipe.id for s in recipe.suggest(base, limit=5)) == "TF-CUSTOM-OP"


@pytest.mark.parametrize("fact, expected", [("numpy.unseeded_generator", "PY-NP-GENERATOR"),
                                            ("python.unseeded_random", "PY-ENTROPY"),
                                            (None, "CUSTOM-OP")])
def test_a_custom_op_drawing_from_an_unseeded_generator_gets_the_generators_recipe(
        fact: str | None, expected: str) -> None:
    """PyTorch round 14: a ``torch.library.custom_op`` whose NumPy kernel drew from an
    unseeded ``np.random.default_rng()`` got CUSTOM-OP ("reduce in thread-completion or
    atomic order") first; the generator is why, and its fix is verified by a patch."""
    facts = {"custom_op": True, "op": "trial.shrink.default", **({fact: True} if fact else {})}
    assert _ids(**facts)[0] == expected, _ids(**facts)


@pytest.mark.parametrize("localized", [False, True])
def test_an_unplaced_difference_under_steps_per_execution_says_to_compile_with_one(
        localized: bool) -> None:
    """TensorFlow round 11: with ``steps_per_execution=4`` noise entering at batch 6 was
    "rare or timing-dependent" with TF-UNKNOWN-OP ("enable_op_determinism", did not help):
    the op records of a call are its first step's, so the op-level re-runs cannot place it."""
    found = recipe.suggest({"framework": "tensorflow", "tensorflow_version": "2.21.0",
                            "kind": "op", "localized": localized,
                            "tf.steps_per_execution": True}, limit=10)
    ids = [s.recipe.id for s in found]
    assert (ids[0] == "TF-STEPS-PER-EXECUTION") is (not localized), ids
    if not localized:
        assert "steps_per_execution=1" in found[0].fix


@pytest.mark.parametrize("evidence, expected", [
    ({"python.threads": True}, "PY-THREAD-WORK"),
    ({"python.clock_reads": True}, "PY-CLOCK-VALUE"),
    ({}, "PT-RNG"),
])
def test_a_random_op_in_a_script_that_seeds_torch_names_what_drew_in_between(
        evidence: dict[str, bool], expected: str) -> None:
    """PyTorch round 15: an actor thread sampling from the global generator while the learner
    trained with dropout, and a validation run every 0.05 s of wall time drawing from it,
    both got PT-RNG first, whose fix (torch.manual_seed) the scripts already had."""
    ids = _ids(op="aten.bernoulli_.float", device="cpu", rng_op=True,
               **{"torch.seeded_by_script": True, **evidence})
    assert ids[0] == expected, ids


@pytest.mark.parametrize("kind, facts, expected", [
    # TensorFlow round 12: Keras fit's batches enter as tf_data
    ("entry", {"entry_kind": "tf_data", "python.completion_order": True},
     "PY-COMPLETION-ORDER"),
    # a callback stopping training after a time budget: one run went on for more steps
    ("structure", {"python.clock_reads": True}, "PY-CLOCK-VALUE"),
])
def test_tensorflow_findings_get_the_scripts_own_evidence(kind: str, facts: dict[str, object],
                                                          expected: str) -> None:
    found = recipe.suggest({"framework": "tensorflow", "tensorflow_version": "2.21.0",
                            "kind": kind, **facts}, limit=10)
    assert found[0].recipe.id == expected, [s.recipe.id for s in found]


@pytest.mark.parametrize("facts", [
    {"kind": "entry", "entry_kind": "external", "op": "parameter 0.weight"},
    {"kind": "op", "op": "aten.zeros_like.default", "phase": "optimizer",
     "state.changed_outside_ops": True}], ids=["parameter entry", "changed outside"])
def test_a_tensor_changed_outside_the_ops_in_a_script_with_threads_is_the_threads(
        facts: dict[str, object]) -> None:
    """Trial round 17: a ``threading.Thread`` shrinking a weight in place while the main
    thread trained got PT-HOGWILD ("several processes update shared-memory parameters")
    for a one-process script, the thread never named. Without threads: still Hogwild."""
    assert _ids(**facts, **{"python.threads": True})[:2] == ["PY-THREAD-WORK", "PT-HOGWILD"]
    assert _ids(**facts, **{"python.threads": False})[0] == "PT-HOGWILD"

