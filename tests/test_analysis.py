"""The verdict follows the training state (analysis.compare_captures), on synthetic captures
written by the real store, and on real scripts through the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from nondet import analysis
from nondet.errors import NondetError
from nondet.records import Group, Kind, Phase
from nondet.report import Report, text
from nondet.store import open_capture
from tests.conftest import OpStream, run_cli, step_rows, write_capture

STEPS = [{"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "loss_fp": 7, "grads_fp": 2,
                                        "params_fp": 3, "rng_fp": 9},
         {"step": 1, "loss": 0.25, "loss_fp": 8, "grads_fp": 4, "params_fp": 5, "rng_fp": 11}]


def _ops(metric: int) -> OpStream:
    s = OpStream()
    s.add(0, "aten.mm.default", out=10, inputs=1, source="train.py:3")
    s.add(0, "aten.sum.default", out=metric, inputs=10, source="train.py:9")  # a logged metric
    return s


def test_a_difference_that_never_reaches_training_is_a_note(tmp_path: Path) -> None:
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS), _ops(20), attrs={"op_steps": [0]})
    b = write_capture(tmp_path / "b.h5", step_rows(*STEPS), _ops(21), attrs={"op_steps": [0]})
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    assert report.verdict == "deterministic" and int(report.exit_code) == 0
    assert report.first_divergence is None
    assert report.contained == [{"kind": "contained", "step": 0, "phase": "forward",
                                 "op": "aten.sum.default", "source": "train.py:9"}]
    assert any("never reached training" in n for n in report.notes)


def _with_one_field_changed_in_b(tmp_path: Path, field: str, value: int) -> Report:
    """The report for two captures of STEPS that differ only in b's ``field`` at row 2."""
    b_steps = step_rows(*STEPS)
    b_steps[2][field] = value
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS))
    b = write_capture(tmp_path / "b.h5", b_steps)
    return analysis.compare_captures(open_capture(a), open_capture(b))


def test_only_the_rng_state_differing_is_a_note(tmp_path: Path) -> None:
    report = _with_one_field_changed_in_b(tmp_path, "rng_fp", 12)
    assert report.verdict == "deterministic" and report.contained


def test_training_state_that_differs_stays_a_finding(tmp_path: Path) -> None:
    report = _with_one_field_changed_in_b(tmp_path, "params_fp", 6)
    assert report.verdict == "nondeterministic" and report.first_divergence is not None
    assert report.first_divergence.step == 1


def test_final_weights_that_differ_are_never_deterministic(tmp_path: Path) -> None:
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS),
                      facts={"final_params_fp": "00000000000000aa"})
    b = write_capture(tmp_path / "b.h5", step_rows(*STEPS),
                      facts={"final_params_fp": "00000000000000bb"})
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    assert report.verdict == "nondeterministic"
    assert report.first_divergence is not None
    assert report.first_divergence.step_fields == ["final params"]


def test_parameters_a_child_process_left_behind_that_differ_are_never_deterministic(
        tmp_path: Path) -> None:
    """Hogwild: no step in the main process; the tensors handed to child #1 differ when
    joined (child #0's and #2's match)."""
    init_only = [{"step": -1, "params_fp": 1}]
    same = {"child#0.params_fp": "00000000000000cc", "final_params_fp": "00000000000000dd"}
    a = write_capture(tmp_path / "a.h5", step_rows(*init_only),
                      facts={**same, "child#10.params_fp": "0a", "child#2.params_fp": "2a"})
    b = write_capture(tmp_path / "b.h5", step_rows(*init_only),
                      facts={**same, "child#10.params_fp": "0b", "child#2.params_fp": "2b"})
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    assert report.verdict == "nondeterministic"
    assert report.first_divergence is not None
    assert report.first_divergence.step_fields == ["child #2 params"]  # the first created
    assert "child process #2" in report.first_divergence.notes[0]


def test_training_only_in_matching_children_is_not_deterministic(tmp_path: Path) -> None:
    init_only = [{"step": -1, "params_fp": 1}]
    facts = {"child#0.params_fp": "00000000000000cc"}
    a = write_capture(tmp_path / "a.h5", step_rows(*init_only), facts=facts)
    b = write_capture(tmp_path / "b.h5", step_rows(*init_only), facts=facts)
    with pytest.raises(NondetError, match="training ran in child processes"):
        analysis.compare_captures(open_capture(a), open_capture(b))


def test_no_training_step_means_nothing_was_compared(tmp_path: Path) -> None:
    init_only = [{"step": -1, "params_fp": 1}]
    a = write_capture(tmp_path / "a.h5", step_rows(*init_only))
    b = write_capture(tmp_path / "b.h5", step_rows(*init_only))
    with pytest.raises(NondetError, match="no training step was observed"):
        analysis.compare_captures(open_capture(a), open_capture(b))


@pytest.mark.e2e
def test_a_script_that_trains_nothing_is_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('usage: train.py [--epochs N]')\n")
    result = run_cli("run", "-q", "--out", str(tmp_path / "out"), str(script), timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no training step was observed" in result.stderr


@pytest.mark.e2e
def test_a_racy_logged_metric_is_a_note_not_a_verdict(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        torch.set_num_threads(2)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(8, 4)
        idx = torch.randint(0, 2000, (200000,))
        vals = torch.randn(200000, 32)
        for step in range(3):
            loss = model(x).pow(2).mean()
            with torch.no_grad():  # a logged metric: accumulated in thread order, never trained on
                table = torch.zeros(2000, 32).index_put((idx,), vals, accumulate=True)
                print("metric", float(table.sum()))
            opt.zero_grad()
            loss.backward()
            opt.step()
        """))
    report_path = tmp_path / "report.json"
    result = run_cli("run", "-q", "--ops", "all", "--out", str(tmp_path / "out"), "--json",
                     str(report_path), str(script), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["verdict"] == "deterministic"
    assert report["contained"] and report["contained"][0]["source"].endswith("train.py:13")
    assert report["contained"][0]["op"] == "aten.index_put.default"


def test_an_interrupted_capture_is_compared_over_the_common_steps(tmp_path: Path) -> None:
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS))
    b = write_capture(tmp_path / "b.h5", step_rows(*STEPS[:2]), status="interrupted")
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    assert report.verdict == "deterministic", report.first_divergence


def test_a_run_stopped_at_max_steps_matches_a_longer_baseline(tmp_path: Path) -> None:
    a = write_capture(tmp_path / "baseline.h5", step_rows(*STEPS))
    b = write_capture(tmp_path / "now.h5", step_rows(*STEPS[:2]), status="stopped")
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    assert report.verdict == "deterministic", report.first_divergence


def test_runs_that_end_on_their_own_after_different_step_counts_differ(tmp_path: Path) -> None:
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS))
    b = write_capture(tmp_path / "b.h5", step_rows(*STEPS[:2]))
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    div = report.first_divergence
    assert report.verdict == "nondeterministic" and div is not None
    assert div.kind == "structure" and div.step == 1
    assert "run b ended after 1 steps, run a after 2" in div.notes[0]


def test_a_run_that_ends_early_while_the_other_went_on_differs(tmp_path: Path) -> None:
    # lockstep stops run a once run b has ended: b exited after 1 step (sys.exit in one run
    # only), a had already recorded step 1
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS), status="stopped")
    b = write_capture(tmp_path / "b.h5", step_rows(*STEPS[:2]))
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    div = report.first_divergence
    assert report.verdict == "nondeterministic" and div is not None
    assert div.kind == "structure" and div.step == 1
    assert "run b ended after 1 steps, run a went on to 2" in div.notes[0]
    shown = "\n".join(text.lines(report))
    assert "step 1: one run ended, the other went on" in shown  # no "other" phase shown
    assert "None" not in shown  # was "record #None: run a executed None, run b None"


def test_a_run_that_ended_early_names_the_line_that_ended_it(tmp_path: Path) -> None:
    # the child records the user's line of a sys.exit / os._exit (nondet.exit_place); the
    # finding named no source line before
    from nondet.exit_place import EXIT_FACT

    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS), status="stopped")
    b = write_capture(tmp_path / "b.h5", step_rows(*STEPS[:2]),
                      facts={EXIT_FACT: {"source": "train.py:12", "how": "sys.exit"}})
    div = analysis.compare_captures(open_capture(a), open_capture(b)).first_divergence
    assert div is not None and div.kind == "structure" and div.source == "train.py:12"
    assert "run b ended after 1 steps at sys.exit() in train.py:12" in div.notes[0]
    crafted = write_capture(tmp_path / "c.h5", step_rows(*STEPS[:2]),
                            facts={EXIT_FACT: ["not", "a", "place"]})
    div = analysis.compare_captures(open_capture(a), open_capture(crafted)).first_divergence
    assert div is not None and div.kind == "structure" and div.source is None


def _ops_two_steps(weight_at_step_1: int) -> OpStream:
    s = OpStream()
    s.add(0, "external:parameter w", out=1, kind=Kind.ENTRY, source="train.py:5")
    s.add(0, "aten.mm.default", out=10, inputs=1, source="train.py:5")
    s.add(0, "aten.add_.Tensor", out=3, inputs=1, phase=Phase.OPTIMIZER, source="train.py:7")
    s.add(1, "external:parameter w", out=weight_at_step_1, kind=Kind.ENTRY, source="train.py:5")
    s.add(1, "aten.mm.default", out=10 + weight_at_step_1, inputs=weight_at_step_1,
          source="train.py:5")
    return s


def test_state_changed_after_a_steps_last_op_is_found_where_the_next_step_reads_it(
        tmp_path: Path) -> None:
    """Every op of step 0 matched but its end state differs (another process wrote the
    shared weights after the optimizer's update): the finding is the entry at step 1 that
    read the changed value, not an unplaced 'op' with no op."""
    b_steps = step_rows(*STEPS)
    b_steps[1]["params_fp"] = 33
    b_steps[2]["params_fp"] = 55
    a = write_capture(tmp_path / "a.h5", step_rows(*STEPS), _ops_two_steps(3),
                      attrs={"op_steps": [0, 1]})
    b = write_capture(tmp_path / "b.h5", b_steps, _ops_two_steps(33),
                      attrs={"op_steps": [0, 1]})
    div = analysis.compare_captures(open_capture(a), open_capture(b)).first_divergence
    assert div is not None and div.kind == "entry" and div.step == 1, div
    assert div.op == "parameter w" and div.source == "train.py:5"
    assert any("changed outside the ops" in n for n in div.notes)


@pytest.mark.parametrize(("label_b", "placed"), [
    ("external:graph input @ train.py:7", True),
    ("external:graph input", False),  # run b saw it where something could have differed first
])
def test_data_named_from_the_step_rows_keeps_its_line_only_when_both_runs_name_it(
        tmp_path: Path, label_b: str, placed: bool) -> None:
    # Step 0 not recorded op by op (a TensorFlow first pair): the data rows name the entry;
    # a line only one run gave is no place to name (the pipeline then narrows).
    steps = [{"step": -1, "params_fp": 1}, {"step": 0, "data_fp": 0, "params_fp": 3}]
    rows = {"a": ("external:graph input @ train.py:7", 5), "b": (label_b, 6)}
    captures = []
    for label, (name, fp) in rows.items():
        steps[1]["data_fp"] = fp
        steps[1]["params_fp"] = 10 + fp  # the data reached training
        captures.append(open_capture(write_capture(
            tmp_path / f"{label}.h5", step_rows(*steps), attrs={"op_steps": [-1]},
            tensors=[(0, int(Group.DATA), name, fp, 0.0, 0.0, 4)])))
    div = analysis.compare_pair(*captures).first_divergence
    assert div is not None and (div.kind, div.step, div.op) == ("entry", 0, "graph input")
    assert div.source == ("train.py:7" if placed else None)


def test_an_op_found_under_a_tf_distribute_strategy_says_the_replicas_were_not_compared(
        tmp_path: Path) -> None:
    """Trial: a racy PyFunc inside strategy.run was reported as "AddN ... its output
    differs while all its inputs matched" at the strategy.reduce line, with no word that
    the replicas' ops, its inputs' makers, are not recorded."""
    captures = []
    for label, out in (("a", 11), ("b", 12)):
        ops = OpStream().add(0, "AddN@replica_sum", out, 1, source="train.py:28")
        captures.append(open_capture(write_capture(
            tmp_path / f"{label}.h5", step_rows({"step": -1}, {"step": 0, "loss_fp": out}),
            ops, facts={"framework": "tensorflow", "tf.distribute.strategy": True},
            attrs={"op_steps": [0]})))
    div = analysis.compare_pair(*captures).first_divergence
    assert div is not None and div.kind == "op"
    assert any(n == analysis.STRATEGY_OP_NOTE for n in div.notes), div.notes


def test_data_that_differed_earlier_without_reaching_training_is_noted(tmp_path: Path) -> None:
    """A replay buffer: a transition enters with a clock-made difference at step 1 and is
    trained on at step 3; the finding is where it is read, and a note names the earlier
    entry (the step it was passed over at, compare.first_step_divergence)."""
    captures = []
    for label, (data, params) in (("a", (5, 30)), ("b", (6, 31))):
        steps = step_rows({"step": -1, "params_fp": 1}, {"step": 0, "params_fp": 2},
                          {"step": 1, "data_fp": data, "params_fp": 3},
                          {"step": 2, "params_fp": 4}, {"step": 3, "params_fp": params})
        captures.append(open_capture(write_capture(tmp_path / f"{label}.h5", steps)))
    found = analysis.compare_pair(*captures)
    assert found.first_divergence is not None and found.first_divergence.step == 3
    assert any("earlier, at step 1" in n for n in found.notes), found.notes


def test_data_that_differed_at_init_is_named_at_init_not_step_minus_1(tmp_path: Path) -> None:
    # trial round 19: "entered with different values earlier, at step -1"
    rows = [{"step": -1, "data_fp": 1, "params_fp": 5}, {"step": 0, "params_fp": 6},
            {"step": 1, "params_fp": 7}]
    a = write_capture(tmp_path / "a.h5", step_rows(*rows))
    rows[0]["data_fp"], rows[2]["params_fp"] = 2, 8  # data differs at init, state at step 1
    b = write_capture(tmp_path / "b.h5", step_rows(*rows))
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    assert report.first_divergence is not None and report.first_divergence.step == 1
    notes = [n for n in report.notes if "entered with different values earlier" in n]
    assert len(notes) == 1 and "earlier, at init, without" in notes[0], report.notes
