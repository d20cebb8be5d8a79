"""Faults, tenth round (FINDINGS.md): scripts that change the import machinery nondet's
hooks run under, and more."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from nondet.frameworks.base import StepLifecycle
from nondet.progress import Progress
from tests.conftest import run_cli, tiny_training


def test_a_script_that_hides_numpy_from_itself_is_compared(tmp_path: Path) -> None:
    """``sys.modules["numpy"] = None`` (a job that must not use NumPy): nondet's hooks
    imported a part of the store (and NumPy) on the first line they recorded, exit 3
    "internal error: ModuleNotFoundError: import of numpy halted"."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nimport torch\nsys.modules['numpy'] = None\n"
                      + tiny_training(steps=3))
    result = run_cli("run", "-q", "--no-verify", "--ops", "all", str(script), cwd=tmp_path,
                     timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bitwise identical" in result.stdout


REEXECS = """
import os, sys
if os.environ.get("REEXEC_DONE") != "1":  # re-run itself with a variable set first
    os.environ["REEXEC_DONE"] = "1"
    os.execv(sys.executable, sys.orig_argv)
"""


def test_a_script_that_re_executes_itself_is_told_what_to_do(tmp_path: Path) -> None:
    """``os.execv(sys.executable, sys.orig_argv)`` re-ran ``-m nondet.boot``, which failed
    without its config: "the script failed in run a: KeyError: 'NONDET_CHILD_CONFIG'"
    (nondet's error as the script's). ``sys.orig_argv`` is now the plain run's, the
    re-run is plain python, and the run has no step nondet recorded."""
    script = tmp_path / "train.py"
    script.write_text(REEXECS + tiny_training(steps=3))
    result = run_cli("run", "-q", "--no-verify", str(script), "--lr", "1", cwd=tmp_path,
                     timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "replaced its process (os.execv at train.py:5)" in lines[0]
    assert "KeyError" not in result.stderr


def test_the_script_sees_the_command_line_plain_python_gives_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('orig:', sys.orig_argv[1:], flush=True)\n"
                      + tiny_training(steps=2))
    result = run_cli("run", "--no-verify", "--json", "r.json", str(script), "--lr", "1",
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = sorted(tmp_path.glob(".nondet/*/run-a.log"))
    assert f"orig: [{str(script)!r}, '--lr', '1']" in logs[-1].read_text()


_TRAINS_LATER = {
    "atexit": ("import atexit\n{train}\ndef finish():\n    train(3)\n    print('done')\n"
               "atexit.register(finish)\ntrain(2)\n", 5),
    "unjoined thread": ("import threading, time\n{train}\n"
                        "threading.Thread(target=lambda: (time.sleep(0.5), train(4))).start()\n",
                        4),
}
_TRAIN = ("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 2)\n"
          "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
          "x, y = torch.randn(16, 8), torch.randn(16, 2)\n"
          "def train(steps):\n"
          "    for _ in range(steps):\n"
          "        loss = (model(x) - y).pow(2).mean()\n"
          "        opt.zero_grad(); loss.backward(); opt.step()\n")


@pytest.mark.parametrize("how", sorted(_TRAINS_LATER))
def test_training_after_the_main_module_is_recorded_before_the_end(tmp_path: Path,
                                                                   how: str) -> None:
    """Steps Python runs after the main module (non-daemon threads it waits for, then
    ``atexit`` functions) came after the run had sent its end: "one run ended, the other
    went on", exit 1 for a deterministic script (5 of 5, faults round 10)."""
    source, steps = _TRAINS_LATER[how]
    script = tmp_path / "train.py"
    script.write_text(source.format(train=_TRAIN))
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script),
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["steps"] for r in report["runs"]] == [steps, steps]


def test_the_script_sees_no_variable_of_nondets(tmp_path: Path) -> None:
    """NONDET_INVOCATION_STARTED (a new time at each invocation) stayed in the script's
    environment: a seed derived from os.environ differed from its baseline's, made by
    another invocation ("FAIL" from `nondet check --baseline`, 3 of 3)."""
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('seen:', sorted(k for k in os.environ "
                      "if k.startswith('NONDET')), flush=True)\n" + tiny_training(steps=2))
    result = run_cli("run", "-q", "--no-verify", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = sorted(tmp_path.glob(".nondet/*/run-a.log"))
    assert "seen: []" in logs[-1].read_text()


def test_an_optimizer_step_in_inference_mode_at_a_window_end_runs(tmp_path: Path) -> None:
    """opt.step() inside torch.inference_mode() at the op window's last step: nondet took
    its dispatch mode off the stack in there, and leaving inference_mode put the Python
    dispatch key back with no mode: "the script failed: ... Hit Python dispatch key" at the
    next op (4 of 4), where plain python ran it."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\ntorch.manual_seed(0)\nm = torch.nn.Linear(8, 4)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "x, y = torch.randn(16, 8), torch.randn(16, 4)\n"
        "for i in range(4):\n"
        "    opt.zero_grad(); ((m(x) - y) ** 2).mean().backward()\n"
        "    if i == 0:\n"
        "        with torch.inference_mode():\n"
        "            opt.step()\n"
        "    else:\n"
        "        opt.step()\n")
    result = run_cli("run", "-q", "--no-verify", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_framework_imported_before_the_script_is_recorded(tmp_path: Path) -> None:
    """A cluster's sitecustomize imports torch at start-up, before nondet's hooks: its
    backend was never made, "no training step was observed in either run"."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.set_num_threads(1)\n")
    script = tmp_path / "train.py"
    script.write_text(tiny_training(steps=3))
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script), cwd=tmp_path,
                     env={"PYTHONPATH": os.pathsep.join(paths)}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["steps"] for r in report["runs"]] == [3, 3]


def test_a_name_holding_a_nul_is_stored(tmp_path: Path) -> None:
    """``nondet.probe(t, "\\x00nul")`` or a module added as "a\\x00b": the capture's string
    table (HDF5) refused it, "VLEN strings do not support embedded NULLs", exit 3."""
    script = tmp_path / "train.py"
    script.write_text(
        "import nondet\nimport torch\ntorch.manual_seed(0)\n"
        "model = torch.nn.Sequential()\nmodel.add_module('a\\x00b', torch.nn.Linear(8, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(3):\n"
        "    out = model(torch.randn(4, 8))\n"
        "    nondet.probe(out, '\\x00nul')\n"
        "    opt.zero_grad(); out.pow(2).mean().backward(); opt.step()\n")
    result = run_cli("run", "-q", "--no-verify", "--ops", "all", str(script), cwd=tmp_path,
                     timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


class _Sources:
    def user_file(self, filename: str) -> bool:
        return "site-packages" not in filename and "/nondet/" not in filename


class _Hooks:
    """What ``StepLifecycle.guarded`` uses of a backend."""

    def __init__(self) -> None:
        self.session = type("S", (), {"sources": _Sources()})()
        self.failures = 0

    def hook_failed(self) -> None:
        self.failures += 1


class StepTimeout(Exception):
    """A script's own exception, as its SIGALRM watchdog raises it."""


@pytest.mark.parametrize("exc,reaches_script", [
    (StepTimeout("a step took too long"), True),
    (type("Fired", (Exception,), {"__module__": "__main__"})(), True),  # the script's own
    (ValueError("nondet's own bug"), False),
])
def test_the_scripts_own_exception_raised_in_a_hook_reaches_the_script(
        exc: Exception, reaches_script: bool) -> None:
    """Faults round 10: a watchdog's exception fired inside nondet's hook was taken for
    nondet's error (exit 3) and swallowed: the script never saw its timeout."""
    hooks = _Hooks()
    raised = None
    try:
        with StepLifecycle.guarded(hooks):  # type: ignore[arg-type]
            raise exc
    except Exception as caught:
        raised = caught
    assert (raised is exc) is reaches_script
    assert hooks.failures == (0 if reaches_script else 1)


def test_a_verify_budget_of_nan_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(tiny_training(steps=2))
    result = run_cli("run", "--verify-budget", "nan", str(script), cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "'--verify-budget': nan is not a number of seconds" in result.stderr
    assert not (tmp_path / ".nondet").exists()  # refused before any run


def test_a_script_on_jax_is_told_so(tmp_path: Path) -> None:
    """Keras 3 on its JAX backend trains where nondet records nothing: the message asked to
    check that the script trains (h-tf10). A stand-in ``jax`` module beside the script."""
    (tmp_path / "jax.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text("import jax\nprint('trained with jax')\n")
    result = run_cli("run", "-q", "--no-verify", str(script), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the script uses JAX" in result.stderr and "KERAS_BACKEND" in result.stderr


def test_progress_off_a_terminal_ends_on_the_last_status() -> None:
    """In a CI log the throttled status read "step 0: both runs done" for a whole run of
    200 steps that took less than the throttle (PyTorch round 13)."""
    out = io.StringIO()
    with Progress(Console(file=out, force_terminal=False, width=200)) as progress:
        for step in range(200):
            progress.status(f"step {step}: both runs done")
        progress.stage("the runs differ at step 199")
        progress.status("step 200: both runs done")
    assert out.getvalue().splitlines() == [
        "nondet: step 0: both runs done", "nondet: step 199: both runs done",
        "nondet: the runs differ at step 199", "nondet: step 200: both runs done"]
