"""The JSON ``growth`` block pinned: what the captures tell about each step, and null where
they cannot tell (never a guessed figure)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from nondet import analysis
from nondet.records import Group
from nondet.store import open_capture
from tests.conftest import step_rows, write_capture

STEPS: list[dict[str, Any]] = [{"step": -1, "params_fp": 1},
         {"step": 0, "loss": 0.5, "params_fp": 10, "grads_fp": 20, "optim_fp": 30,
          "params_sum": 10.0},
         {"step": 1, "loss": 0.25, "params_fp": 11, "grads_fp": 21, "optim_fp": 31,
          "params_sum": 10.25},
         {"step": 2, "loss": 0.125, "params_fp": 12, "grads_fp": 0, "optim_fp": 32,
          "params_sum": 10.5}]
# Step 1 is a detailed step: per tensor (step, group, name, fp, sum, maxabs, numel).
TENSORS_A = [(1, Group.PARAM, "w", 100, 1.0, 0.5, 4), (1, Group.PARAM, "b", 101, 0.0, 0.0, 2),
             (1, Group.GRAD, "w", 200, 2.0, 1.0, 4), (1, Group.GRAD, "b", 201, 0.0, 0.0, 2),
             (1, Group.OPTIM, "w", 300, 3.0, 1.0, 4)]
TENSORS_B = [(1, Group.PARAM, "w", 900, 1.0000004, 0.5000003, 4),
             (1, Group.PARAM, "b", 101, 0.0, 0.0, 2),
             (1, Group.GRAD, "w", 901, 2.000008, 1.0, 4), (1, Group.GRAD, "b", 201, 0.0, 0.0, 2),
             (1, Group.OPTIM, "w", 300, 3.0, 1.0, 4)]

SAME = {"differs": False, "max_abs_diff": 0.0, "frac_differ": 0.0, "max_abs_diff_min": 0.0,
        "frac_differ_max": 0.0, "sum_abs_diff": 0.0, "tensors": None, "tensors_differ": None}
UNRECORDED = {"differs": None, "max_abs_diff": None, "frac_differ": None,
              "max_abs_diff_min": None, "frac_differ_max": None, "sum_abs_diff": None,
              "tensors": None, "tensors_differ": None}
EXPECTED: list[dict[str, Any]] = [
    {"step": 0, "loss_a": 0.5, "loss_b": 0.5, "loss_abs_diff": 0.0, "differing": [],
     "params_sum_a": 10.0, "params_sum_b": 10.0,
     "params_max_abs_diff": 0.0, "params_frac_differ": 0.0,
     "grads_max_abs_diff": 0.0, "grads_frac_differ": 0.0,
     "optimizer_max_abs_diff": 0.0, "optimizer_frac_differ": 0.0,
     "state": {"params": SAME, "grads": SAME, "optimizer": SAME}},
    {"step": 1, "loss_a": 0.25, "loss_b": 0.2500001, "loss_abs_diff": 1e-7,
     "differing": ["grads", "params"], "params_sum_a": 10.25, "params_sum_b": 10.2500004,
     # differing fingerprints: the exact figures are unknown, only bounded
     "params_max_abs_diff": None, "params_frac_differ": None,
     "grads_max_abs_diff": None, "grads_frac_differ": None,
     "optimizer_max_abs_diff": 0.0, "optimizer_frac_differ": 0.0,
     "state": {
         # | |a|max - |b|max | = 3e-7 beats |sum a - sum b| / 4 = 1e-7; 4 of 6 elements at most;
         # the parameters' sum from the step row
         "params": {"differs": True, "max_abs_diff": None, "frac_differ": None,
                    "max_abs_diff_min": 3e-7, "frac_differ_max": 4 / 6,
                    "sum_abs_diff": 4e-7, "tensors": 2, "tensors_differ": 1},
         # equal largest magnitudes: the sum gives the bound, 8e-6 / 4
         "grads": {"differs": True, "max_abs_diff": None, "frac_differ": None,
                   "max_abs_diff_min": 2e-6, "frac_differ_max": 4 / 6,
                   "sum_abs_diff": 8e-6, "tensors": 2, "tensors_differ": 1},
         "optimizer": SAME}},
    {"step": 2, "loss_a": 0.125, "loss_b": None, "loss_abs_diff": None,
     "differing": ["loss", "params"], "params_sum_a": 10.5, "params_sum_b": 11.0,
     "params_max_abs_diff": None, "params_frac_differ": None,
     "grads_max_abs_diff": None, "grads_frac_differ": None,
     "optimizer_max_abs_diff": 0.0, "optimizer_frac_differ": 0.0,
     "state": {
         # not a detailed step: no bounds, only the step row's sum
         "params": {"differs": True, "max_abs_diff": None, "frac_differ": None,
                    "max_abs_diff_min": None, "frac_differ_max": None, "sum_abs_diff": 0.5,
                    "tensors": None, "tensors_differ": None},
         "grads": UNRECORDED,  # no gradient fingerprint in this step (traced updates)
         "optimizer": SAME}},
]


def _captures(tmp_path: Path) -> tuple[Path, Path]:
    a_steps, b_steps = step_rows(*STEPS), step_rows(*STEPS)
    b_steps[2]["loss"], b_steps[2]["params_fp"], b_steps[2]["grads_fp"] = 0.2500001, 91, 92
    b_steps[2]["params_sum"] = 10.2500004
    b_steps[3]["loss"], b_steps[3]["params_fp"], b_steps[3]["loss_fp"] = math.nan, 93, 7
    b_steps[3]["params_sum"] = 11.0
    return (write_capture(tmp_path / "a.h5", a_steps, tensors=TENSORS_A),
            write_capture(tmp_path / "b.h5", b_steps, tensors=TENSORS_B))


def _close(got: Any, want: Any, where: str = "growth") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-6,
                                                       abs_tol=1e-12), (where, got, want)
    else:
        assert got == want, (where, got, want)


def test_growth_block_is_pinned(tmp_path: Path) -> None:
    a, b = _captures(tmp_path)
    report = analysis.compare_captures(open_capture(a), open_capture(b))
    assert report.verdict == "nondeterministic"
    _close(report.to_json()["growth"], EXPECTED)


def test_tensors_named_differently_give_no_bounds(tmp_path: Path) -> None:
    a, b = _captures(tmp_path)
    renamed = [(s, g, f"other.{n}", *rest) for s, g, n, *rest in TENSORS_B]
    b = write_capture(tmp_path / "b2.h5", open_capture(b).steps, tensors=renamed)
    params = analysis.compare_captures(open_capture(a), open_capture(b)).growth[1].params
    assert params.differs and params.max_abs_diff_min is None and params.tensors is None
