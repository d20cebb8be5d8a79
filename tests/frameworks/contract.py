"""The backend contract, checked the same way on every framework (docs/adding-a-framework.md).

A framework's test file gives a ``ContractScript``: a small training loop in that framework
with a data entry, a loss, parameters, optimizer state and a ``nondet.probe`` every step,
which prints a digest of its final weights. The checks:

- ``check_step_rows``: every step-row field a framework must fill is filled, at every step;
- ``check_probes``: probes count in every step, and are op records only in the op window;
- ``check_hook_error``: an exception inside nondet's hooks never reaches the script (it runs
  to the end and prints the same weights as a plain run) and ``nondet run`` ends with exit 3
  and a bug log, not "the script failed".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from nondet.launch import CapturedRun, Plan, Target
from nondet.store import Capture, open_capture
from tests.conftest import run_cli

#: Step-row fields every backend fills at every step of a loop like the contract script's.
REQUIRED_FIELDS = ("data_fp", "loss_fp", "grads_fp", "params_fp", "optim_fp", "rng_fp",
                   "probes_fp")

#: Inserted after the framework import: makes the backend's own step-state hook raise from
#: step 1 on, inside nondet's code (the same place for every framework: base.StepLifecycle).
INJECT_HOOK_ERROR = """
import nondet.session as _session_module
_session = _session_module.current()
if _session is not None:
    for _backend in _session.backends:
        _original = _backend._step_state
        def _broken(step, detailed, _original=_original):
            if step >= 1:
                raise ZeroDivisionError("injected into nondet's hook")
            return _original(step, detailed)
        _backend._step_state = _broken
"""


@dataclass(frozen=True)
class ContractScript:
    """A framework's contract loop: ``{inject}`` marks where a test may insert code right
    after the framework import; the script prints ``weights <digest>`` at its end."""

    source: str
    steps: int

    def write(self, folder: Path, inject: str = "") -> Path:
        path = folder / "contract_train.py"
        path.write_text(textwrap.dedent(self.source).replace("{inject}", inject))
        return path


def capture(tmp_path: Path, script: ContractScript, op_steps: list[int] | None) -> Capture:
    path = script.write(tmp_path)
    run = CapturedRun(Target(str(path), None, ()), Plan("contract", op_steps), 0,
                      tmp_path / "out")
    run.start()
    result = run.wait()
    assert result.status == "complete", result.log_tail()
    assert not result.hook_error, result.hook_error
    return open_capture(result.path)


def check_step_rows(c: Capture, script: ContractScript) -> None:
    steps = [r for r in c.steps if int(r["step"]) >= 0]
    assert len(steps) == script.steps
    for row in steps:
        empty = [name for name in REQUIRED_FIELDS if int(row[name]) == 0]
        assert not empty, f"step {int(row['step'])}: {empty} not filled"
        assert row["loss"] == row["loss"], "loss value missing (NaN)"
    assert c.facts.get("framework") in ("torch", "tensorflow")


def check_probes(c: Capture) -> None:
    """Probes count in every step; they are op records only in steps with op capture."""
    window = set(c.op_steps())
    for row in c.steps:
        step = int(row["step"])
        if step < 0:
            continue
        names = [c.string(int(r["name"])) for r in c.ops(step)]
        assert int(row["probes_fp"]) != 0
        assert ("probe:contract" in names) == (step in window), (step, window)


def check_hook_error(tmp_path: Path, script: ContractScript) -> None:
    plain = subprocess.run([sys.executable, str(script.write(tmp_path))], capture_output=True,
                           text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr
    expected = [line for line in plain.stdout.splitlines() if line.startswith("weights ")]
    assert expected

    broken = script.write(tmp_path, inject=INJECT_HOOK_ERROR)
    out = tmp_path / "out"
    result = run_cli("run", "-q", "--schedule", "sequential", "--out", str(out), str(broken),
                     env={"XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=600)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "internal error" in result.stderr and "script failed" not in result.stderr
    logs = list((tmp_path / "cache" / "nondet").glob("nondet-*.log"))
    assert logs and "injected into nondet's hook" in logs[0].read_text()
    run_log = sorted(out.rglob("run-a.log"))
    assert run_log, list(out.rglob("*"))
    # The script itself ran to its end, undisturbed: same weights as without nondet.
    assert [line for line in run_log[0].read_text().splitlines()
            if line.startswith("weights ")] == expected
