"""The injection rule and step-level comparison, on synthetic record streams."""

from __future__ import annotations

import numpy as np

from nondet import compare
from nondet.records import Flag, Kind, Phase
from tests.conftest import OpStream, step_rows


def _pair(build_a: OpStream, build_b: OpStream) -> compare.OpDivergence | None:
    return compare.first_op_divergence(build_a.array(), build_b.array(), build_a.strings,
                                       build_b.strings)


def test_identical_streams_have_no_finding() -> None:
    a = OpStream().add(0, "aten.mm.default", 11, 1).add(0, "aten.relu.default", 12, 11)
    b = OpStream().add(0, "aten.mm.default", 11, 1).add(0, "aten.relu.default", 12, 11)
    assert _pair(a, b) is None


def test_tensorflow_node_names_do_not_count_as_a_difference_but_op_types_do() -> None:
    a = OpStream().add(0, "MatMul@model/dense/MatMul", 11, 1)
    a.add(0, "Tanh@model/dense/Tanh", 12, 11)
    renamed = (
        OpStream().add(0, "MatMul@model_1/dense_1/MatMul", 11, 1)
        .add(0, "Tanh@model_1/dense_1/Tanh", 12, 11)
    )
    assert _pair(a, renamed) is None
    other = OpStream().add(0, "MatMul@model/dense/MatMul", 11, 1)
    other.add(0, "Relu@model/dense/Tanh", 12, 11)
    found = _pair(a, other)
    assert found is not None and found.kind == "structure" and found.position == 1


def test_first_op_with_matching_inputs_and_differing_output_is_the_injection_point() -> None:
    a = (OpStream().add(0, "aten.mm.default", 11, 1).add(0, "aten.index_put.default", 12, 11)
         .add(0, "aten.add.Tensor", 13, 12))
    b = (OpStream().add(0, "aten.mm.default", 11, 1).add(0, "aten.index_put.default", 99, 11)
         .add(0, "aten.add.Tensor", 98, 99))
    found = _pair(a, b)
    assert found is not None and found.kind == "op" and found.position == 1
    assert a.strings[int(found.row_a["name"])] == "aten.index_put.default"
    states = dict(found.context)
    assert states[1] == "differs (inputs same)" and states[2] == "differs (inputs differ)"


def test_propagated_difference_is_not_blamed_on_the_consumer() -> None:
    # The entry (a batch) differs; the op consuming it differs only because its input did.
    a = OpStream().add(0, "dataloader:batch", 5, kind=Kind.ENTRY, phase=Phase.DATA)
    a.add(0, "aten.mm.default", 11, 5)
    b = OpStream().add(0, "dataloader:batch", 6, kind=Kind.ENTRY, phase=Phase.DATA)
    b.add(0, "aten.mm.default", 12, 6)
    found = _pair(a, b)
    assert found is not None and found.kind == "entry" and found.position == 0


def test_uninitialized_outputs_are_never_compared() -> None:
    a = OpStream().add(0, "aten.empty.memory_format", 0, flags=Flag.UNINIT_OUTPUT)
    a.add(0, "aten.uniform_.default", 7, 0, flags=Flag.OVERWRITES_UNINIT)
    b = OpStream().add(0, "aten.empty.memory_format", 0, flags=Flag.UNINIT_OUTPUT)
    b.add(0, "aten.uniform_.default", 7, 0, flags=Flag.OVERWRITES_UNINIT)
    # Even if garbage fingerprints were recorded for the empty output, they are ignored.
    arr_a, arr_b = a.array(), b.array()
    arr_a["out_fp"][0], arr_b["out_fp"][0] = 123, 456
    assert compare.first_op_divergence(arr_a, arr_b, a.strings, b.strings) is None


def test_uninitialized_memory_of_another_size_is_a_python_value_entering() -> None:
    # Trial: an Optuna trial's width (drawn from the sampler's unseeded RandomState) sized
    # nn.Linear's `empty`; its `uniform_` then "created the difference" from matching
    # inputs, and the first fix was `torch.manual_seed` (PT-RNG), which cannot help.
    a = OpStream().add(0, "aten.empty.memory_format", 0, flags=Flag.UNINIT_OUTPUT, numel=130)
    a.add(0, "aten.uniform_.default", 7, 0, flags=Flag.OVERWRITES_UNINIT, numel=130)
    b = OpStream().add(0, "aten.empty.memory_format", 0, flags=Flag.UNINIT_OUTPUT, numel=80)
    b.add(0, "aten.uniform_.default", 8, 0, flags=Flag.OVERWRITES_UNINIT, numel=80)
    found = _pair(a, b)
    assert found is not None and found.position == 0, found
    assert found.kind == "entry" and found.scalar_argument


def test_reading_uninitialized_memory_is_reported_as_such() -> None:
    a = OpStream().add(0, "aten.add.Tensor", 20, 1, taint=5, flags=Flag.READS_UNINIT)
    b = OpStream().add(0, "aten.add.Tensor", 21, 1, taint=6, flags=Flag.READS_UNINIT)
    found = _pair(a, b)
    assert found is not None and found.kind == "op" and found.reads_uninitialized


def test_a_differing_python_number_argument_is_an_entry() -> None:
    a = OpStream().add(0, "aten.mul.Tensor", 20, 1, scalars=3)
    b = OpStream().add(0, "aten.mul.Tensor", 21, 1, scalars=4)
    found = _pair(a, b)
    assert found is not None and found.kind == "entry" and found.scalar_argument


def test_different_ops_at_the_same_position_are_a_structure_finding() -> None:
    a = OpStream().add(0, "aten.mm.default", 11, 1).add(0, "aten.relu.default", 12, 11)
    b = OpStream().add(0, "aten.mm.default", 11, 1).add(0, "aten.tanh.default", 12, 11)
    found = _pair(a, b)
    assert found is not None and found.kind == "structure" and found.position == 1


def test_value_difference_before_a_structure_difference_wins() -> None:
    a = OpStream().add(0, "aten.sum.default", 11, 1).add(0, "aten.relu.default", 12, 11)
    b = OpStream().add(0, "aten.sum.default", 99, 1).add(0, "aten.tanh.default", 12, 99)
    found = _pair(a, b)
    assert found is not None and found.kind == "op" and found.position == 0


def test_extra_records_in_one_run_are_a_structure_finding() -> None:
    a = OpStream().add(0, "aten.mm.default", 11, 1)
    b = OpStream().add(0, "aten.mm.default", 11, 1).add(0, "aten.relu.default", 12, 11)
    found = _pair(a, b)
    assert found is not None and found.kind == "structure" and found.position == 1
    assert found.row_a is None and found.row_b is not None


def test_difference_with_no_origin_is_reported_unexplained() -> None:
    a = OpStream().add(0, "aten.mm.default", 11, 1)
    b = OpStream().add(0, "aten.mm.default", 12, 2)
    found = _pair(a, b)
    assert found is not None and not found.explained and found.position == 0


def test_first_step_divergence_attributes_the_phase_in_pipeline_order() -> None:
    a = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "data_fp": 5, "grads_fp": 7},
                  {"step": 1, "data_fp": 6, "grads_fp": 8, "params_fp": 9})
    b = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "data_fp": 5, "grads_fp": 7},
                  {"step": 1, "data_fp": 6, "grads_fp": 80, "params_fp": 90})
    div = compare.first_step_divergence(a, b)
    assert div is not None and div.step == 1 and div.phase == Phase.BACKWARD
    assert div.fields == ("grads_fp", "params_fp")


def test_init_difference_is_attributed_to_init() -> None:
    a = step_rows({"step": -1, "params_fp": 1}, {"step": 0})
    b = step_rows({"step": -1, "params_fp": 2}, {"step": 0})
    div = compare.first_step_divergence(a, b)
    assert div is not None and div.step == -1 and div.phase == Phase.INIT


def test_missing_steps_are_structural() -> None:
    a = step_rows({"step": -1}, {"step": 0}, {"step": 1})
    b = step_rows({"step": -1}, {"step": 0})
    div = compare.first_step_divergence(a, b)
    assert div is not None and div.structural and div.step == 1
    assert compare.first_step_divergence(a, a.copy()) is None


def test_mismatch_stats_counts_bitwise_differences_and_finds_the_largest() -> None:
    x = np.zeros((4, 5), dtype=np.float32)
    y = x.copy()
    y[1, 2] = 1e-7
    y[3, 4] = -2.5e-3
    stats = compare.mismatch_stats(x, y)
    assert stats["mismatched_elements"] == 2 and stats["numel"] == 20
    assert abs(stats["max_abs_diff"] - 2.5e-3) < 1e-9 and stats["max_abs_diff_at"] == [3, 4]


def test_mismatch_stats_sees_signed_zero_and_nan_payloads() -> None:
    x = np.array([0.0, np.nan], dtype=np.float32)
    y = np.array([-0.0, np.nan], dtype=np.float32)
    y.view(np.uint32)[1] += 1  # another NaN payload
    stats = compare.mismatch_stats(x, y)
    assert stats["mismatched_elements"] == 2


def test_data_that_reached_no_training_state_is_no_training_difference() -> None:
    """Trial: ``torch.tensor(32 / elapsed)`` (a clock reading handed to torch) entered with
    a new value at every step: "nondeterministic", exit 1, for a script whose loss,
    gradients and parameters were bitwise alike at every step."""
    a = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "data_fp": 5, "params_fp": 9},
                  {"step": 1, "data_fp": 6, "params_fp": 10})
    b = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "data_fp": 50, "params_fp": 9},
                  {"step": 1, "data_fp": 60, "params_fp": 10})
    assert not any(compare.training_differs(ra, rb) for ra, rb in zip(a, b, strict=True))
    div = compare.first_step_divergence(a, b)  # still the first difference: for the note
    assert div is not None and div.step == 0 and div.fields == ("data_fp",)
    # a later step that differs in training state is the divergence, not the clock's
    b[2]["params_fp"] = 11
    div = compare.first_step_divergence(a, b)
    assert div is not None and div.step == 1 and div.fields == ("data_fp", "params_fp")
    assert compare.training_differs(a[2], b[2])


def test_data_is_the_training_difference_where_a_step_records_nothing_else() -> None:
    # steps nondet sees only the data of (no loss, gradients, parameters recorded)
    a = step_rows({"step": -1}, {"step": 0, "data_fp": 5})
    b = step_rows({"step": -1}, {"step": 0, "data_fp": 50})
    assert compare.training_differs(a[1], b[1])
    div = compare.first_step_divergence(a, b)
    assert div is not None and div.step == 0 and div.phase == Phase.DATA


def _clocked(steps: int, clock_at: list[int], params_b: dict[int, int] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Two runs' rows: the same params, data differing at ``clock_at`` (a clock reading)."""
    a = step_rows(*({"step": s, "data_fp": 1, "params_fp": 10 + s} for s in range(steps)))
    b = step_rows(*({"step": s, "data_fp": 2 if s in clock_at else 1,
                     "params_fp": (params_b or {}).get(s, 10 + s)} for s in range(steps)))
    return a, b


def test_runs_that_part_only_in_data_that_reached_no_training_repeat() -> None:
    """Review: verification, the narrowing re-runs and --runs asked first_step_divergence,
    which names such a step when nothing else differs: a working fix for a script logging
    its step time would never have "repeated"."""
    a, b = _clocked(8, list(range(8)))
    assert compare.first_step_divergence(a, b) is not None  # still there, for the note
    assert compare.parted(a, b) is None
    assert compare.parted(a, b, count_extra_steps=False) is None  # seen not to reach it
    a, b = _clocked(8, list(range(8)), params_b={6: 99, 7: 98})
    found = compare.parted(a, b)
    assert found is not None and found.step == 6


def test_data_that_differs_at_the_end_of_a_cut_comparison_is_unsettled() -> None:
    """Review: a replay buffer's entry read a few steps later, past where a stopped or
    interrupted capture ends, would have been "never reached training"."""
    a, b = _clocked(6, [4])
    assert compare.data_unsettled(a, b, count_extra_steps=False)
    found = compare.parted(a, b, count_extra_steps=False)
    assert found is not None and found.step == 4
    # both runs ended on their own: nothing more was to come
    assert not compare.data_unsettled(a, b, count_extra_steps=True)
    assert compare.parted(a, b) is None
    # followed by enough steps with the same training state: settled
    a, b = _clocked(9, [4])
    assert not compare.data_unsettled(a, b, count_extra_steps=False)


def _rng_rows(rng_b_from: int, params_b_from: int | None, steps: int = 8) -> tuple[
        np.ndarray, np.ndarray]:
    a = step_rows(*({"step": s, "params_fp": 10 + s, "rng_fp": 100 + s} for s in range(steps)))
    b = step_rows(*({"step": s,
                     "params_fp": 10 + s + (1 if params_b_from is not None
                                            and s >= params_b_from else 0),
                     "rng_fp": 100 + s + (1 if s >= rng_b_from else 0)} for s in range(steps)))
    return a, b


def test_runs_whose_training_repeated_with_only_their_rng_state_apart_repeat_for_a_fix(
        ) -> None:
    """TensorFlow round 11: a verified tf.data fix "parted again at step 2 (another source)"
    where only the Keras augmentation layers' RNG state differed and training repeated."""
    a, b = _rng_rows(rng_b_from=2, params_b_from=None)
    assert compare.parted(a, b) is not None  # the narrowing still sees where it differs
    assert compare.parted_in_training(a, b) is None


def test_an_rng_difference_that_reaches_training_or_is_too_late_to_tell_parts() -> None:
    a, b = _rng_rows(rng_b_from=2, params_b_from=3)
    assert compare.parted_in_training(a, b).step == 2
    a, b = _rng_rows(rng_b_from=6, params_b_from=None)  # one step left to see it reach
    assert compare.parted_in_training(a, b).step == 6


def test_an_rng_difference_that_did_not_reach_training_by_the_last_verified_step_repeats(
        ) -> None:
    """The fix's runs compare up to the last step the first pair had (4 here): an RNG
    difference at step 2 that training never read by then repeats over those steps."""
    a, b = _rng_rows(rng_b_from=2, params_b_from=None, steps=5)
    assert compare.parted_in_training(a, b).step == 2  # 2 steps after it: cannot tell
    assert compare.parted_in_training(a, b, last=4) is None
    a, b = _rng_rows(rng_b_from=2, params_b_from=4, steps=5)
    assert compare.parted_in_training(a, b, last=4).step == 2
