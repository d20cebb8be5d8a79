"""Faults, eleventh round (FINDINGS.md), and the items left from the tenth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nondet import importpath
from tests.conftest import run_cli, tiny_training


@pytest.mark.parametrize("failure", [
    "AttributeError: module 'nondet' has no attribute 'helper'",
    "ImportError: cannot import name 'helper' from 'nondet' (/x/nondet/__init__.py)",
    "ModuleNotFoundError: No module named 'nondet.utils'",
])
def test_a_failure_reaching_for_the_scripts_own_nondet_module_gets_the_hint(
        failure: str) -> None:
    assert importpath.shadowed_hint(failure) == importpath.SHADOWED_HINT


@pytest.mark.parametrize("failure", [
    "AttributeError: module 'numpy' has no attribute 'helper'",
    "ModuleNotFoundError: No module named 'nondetx'",
    "RuntimeError: nondet step failed",
])
def test_other_failures_get_no_such_hint(failure: str) -> None:
    assert importpath.shadowed_hint(failure) == ""


@pytest.mark.e2e
def test_a_scripts_own_nondet_module_is_named_when_the_run_fails(tmp_path: Path) -> None:
    """Trial (faults round 10): a project's ``nondet.py`` beside the script is hidden by
    nondet's package, imported first in a recorded run; plain python runs the script.
    The failure said only "the script failed" with the AttributeError."""
    project = tmp_path / "project"  # not the working directory: ``python -m nondet`` there
    project.mkdir()  # would run the project's module itself, as Python does
    (project / "nondet.py").write_text("def helper():\n    return 3\n")
    (project / "train.py").write_text("import nondet\n" + tiny_training().replace(
        "torch.manual_seed(0)", "torch.manual_seed(nondet.helper())"))
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"),
                   str(project / "train.py"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    first = done.stderr.splitlines()[0]
    assert "module 'nondet' has no attribute 'helper'" in first, done.stderr
    assert importpath.SHADOWED_HINT in first, done.stderr


def test_a_zero_tensor_hashes_as_the_zeros_it_holds() -> None:
    """Forward-mode AD's zero tangents are efficient zero tensors: no memory (data_ptr 0),
    which NumPy refused inside the op recorder (exit 3 on every torch.func.jvp script)."""
    import torch

    from nondet.frameworks.torch import hostwords

    for shape, dtype in (((2, 3), torch.float32), ((5,), torch.float16), ((3,), torch.int8)):
        zero = torch._efficientzerotensor(shape, dtype=dtype)
        assert zero._is_zerotensor() and zero.data_ptr() == 0
        plain = torch.zeros(shape, dtype=dtype)
        assert hostwords.dense_cpu_content(zero) == hostwords.dense_cpu_content(plain)
        assert hostwords.raw_bytes(zero).tobytes() == hostwords.raw_bytes(plain).tobytes()


_JVP_TRAINING = """
import random
import torch
from torch.func import jvp
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Softplus(), torch.nn.Linear(16, 6))
opt = torch.optim.Adam(net.parameters(), 3e-3)
shift = random.Random()  # unseeded: enters at step 2
for step in range(4):
    z = torch.randn(8, 4) + (shift.random() if step == 2 else 0.0)
    _, tangent = jvp(lambda x: net(x), (z,), (torch.ones_like(z),))
    loss = net(z).pow(2).mean() + 1e-4 * tangent.pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.e2e
def test_forward_mode_ad_training_is_recorded_and_narrowed(tmp_path: Path) -> None:
    """Trial (PyTorch round 14): a loss with a ``torch.func.jvp`` term was nondet's
    internal error (exit 3) in every run; a difference entering at step 2 is now found
    there, through the op-level re-run that hashes the zero tangents."""
    (tmp_path / "train.py").write_text(_JVP_TRAINING)
    done = run_cli("run", "-q", "--no-verify", "--json", "r.json", "train.py", cwd=tmp_path,
                   timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    div = json.loads((tmp_path / "r.json").read_text())["first_divergence"]
    assert div["step"] == 2 and div["source"] == "train.py:10", div


_SYNCS_BANNED = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 8), torch.randn(16, 4)
def banned(name):
    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"host sync via Tensor.{name} is banned in the training loop")
    return refuse
saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "numpy", "__float__")}
for name in saved:
    setattr(torch.Tensor, name, banned(name))
for step in range(4):
    opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); opt.step()
for name, method in saved.items():
    setattr(torch.Tensor, name, method)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("ops", ["auto", "all"])
def test_a_script_banning_host_syncs_in_its_loop_is_recorded(tmp_path: Path, ops: str) -> None:
    """Trial (faults round 11): a script that makes ``Tensor.item``/``tolist``/``numpy``
    raise while it trains (no host syncs in the loop) ran plainly; nondet's own reads at
    the step end went through the replaced methods: exit 3, "nondet's hooks failed"."""
    (tmp_path / "train.py").write_text(_SYNCS_BANNED)
    done = run_cli("run", "-q", "--no-verify", "--ops", ops, "--out", str(tmp_path / "out"),
                   "train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("nondet: deterministic"), done.stdout


def test_the_scripts_sync_debug_mode_is_off_while_nondet_reads_back() -> None:
    """``torch.cuda.set_sync_debug_mode("error")`` makes every host sync raise: nondet's
    one read-back per step is its own, so the mode is off while it reads and put back."""
    import torch

    from nondet.frameworks.torch import cuda, readback

    modes = [2]
    calls: list[int] = []

    def set_mode(mode: int) -> None:
        calls.append(mode)
        modes[0] = mode

    fake = type("FakeCuda", (), {
        "is_available": staticmethod(lambda: True),
        "is_initialized": staticmethod(lambda: True),
        "get_sync_debug_mode": staticmethod(lambda: modes[0]),
        "set_sync_debug_mode": staticmethod(set_mode),
        "synchronize": staticmethod(lambda device=None: None),
    })
    original = cuda.api
    cuda.api = fake
    try:
        ints, floats = readback.read_back([torch.tensor(7)],
                                          [torch.tensor(0.5, dtype=torch.float64)])
    finally:
        cuda.api = original
    assert (ints, floats) == ([7], [0.5])
    assert calls == [0, 2] and modes == [2]


@pytest.mark.e2e
def test_a_script_that_forbids_threads_while_it_trains_is_recorded(tmp_path: Path) -> None:
    """Trial (faults round 11): a script that replaces ``threading.Thread.start`` after its
    first step (or whose address-space limit leaves no room for a thread) ran plainly;
    nondet's pipe flusher, started at the first step end, failed there: exit 3."""
    script = "import threading\n" + tiny_training().replace(
        "opt.step()", "opt.step()\n    threading.Thread.start = None")
    assert "threading.Thread.start = None" in script
    (tmp_path / "train.py").write_text(script)
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "train.py",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_fix_list_in_the_callers_environment_never_reaches_the_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Faults round 11: ``NONDET_APPLY=torch.deterministic nondet run race.py`` applied the
    fix to both runs without a word, and a racing script was "deterministic" (exit 0,
    ``nondet check`` PASS). Only nondet's own ``--apply`` and fix verification set it."""
    from nondet import interventions, runspec
    from nondet.session import ChildConfig

    monkeypatch.setenv(interventions.APPLY_ENV, "torch.deterministic")
    config = ChildConfig(label="a", seed=0, channel_fd=3, control_fd=4)
    assert interventions.APPLY_ENV not in runspec.child_env(config, {})
    ours = interventions.environment(["torch.one_thread"])
    assert runspec.child_env(config, ours)[interventions.APPLY_ENV] == "torch.one_thread"


@pytest.mark.e2e
def test_a_closed_stderr_under_verbose_does_not_stall_the_runs(tmp_path: Path) -> None:
    """Faults round 11: ``nondet run -v train.py 2>&1 | head`` stalled two minutes, then
    "holds no training step" (exit 2): the run's output echo died on the closed pipe, and
    nothing drained the run's stdout. It is drained into the run's log whatever happens."""
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(tiny_training(6).replace(
        "for step in range(6):\n", "for step in range(6):\n"
        "    for i in range(3000):\n        print('log line', step, i)\n"))
    reader = subprocess.Popen(  # reads one line, then closes the pipe, as head does
        [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    done = subprocess.run([sys.executable, "-m", "nondet", "run", "-v", "--no-verify",
                           "--json", "r.json", "--out", "out", "train.py"],
                          cwd=tmp_path, stdout=reader.stdin, stderr=reader.stdin, timeout=120)
    assert reader.stdin is not None
    reader.stdin.close()
    reader.wait(timeout=30)
    report = json.loads((tmp_path / "r.json").read_text())
    assert done.returncode == 0 and report["verdict"] == "deterministic", report


@pytest.mark.e2e
@pytest.mark.parametrize("mocked", ["os.getpid = lambda: 1", "os.getppid = lambda: 1"])
def test_a_script_mocking_its_pids_is_recorded_to_its_end(tmp_path: Path, mocked: str) -> None:
    """Faults round 11: after ``os.getppid = lambda: 1`` the run thought itself orphaned and
    ended (killed, "the script failed"); after ``os.getpid = lambda: 1`` it thought itself
    a fork and went silent: it hung at exit until the idle limit, and its later steps
    were never compared (a race there was missed). nondet keeps the real functions."""
    (tmp_path / "train.py").write_text("import os, time\n" + tiny_training(4).replace(
        "opt.step()\n", f"opt.step()\n    if step == 1:\n        {mocked}\n"
                        "    time.sleep(0.3)\n"))
    done = run_cli("run", "-q", "--no-verify", "--json", "r.json", "--out",
                   str(tmp_path / "out"), "train.py", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [(r["steps"], r["complete"]) for r in report["runs"]] == [(4, True)] * 2, report
    assert not report["notes"], report["notes"]


_OWN_TRACER = """
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
events = {"line": 0}
here = sys._getframe()
def local(frame, event, arg):
    if event == "line":
        events["line"] += 1
    return local
def outer(frame, event, arg):
    return None
for step in range(6):
    if step == 2:
        here.f_trace = local; here.f_trace_lines = True; sys.settrace(outer)
    opt.zero_grad(); loss = model(torch.ones(2, 8)).pow(2).mean(); loss.backward(); opt.step()
sys.settrace(None)
print("line events", events["line"])
"""


@pytest.mark.e2e
def test_a_tracer_the_script_sets_on_its_loop_keeps_its_events(tmp_path: Path) -> None:
    """Faults round 11: a script's own line tracer on its loop frame (a coverage tool, a
    debugger started mid-run) saw 1 line event instead of 15: nondet's loop watch cleared
    the frame's tracer at every step end, whoever had set it."""
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(_OWN_TRACER)
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, check=True).stdout
    assert "line events" in plain and "line events 0" not in plain
    done = run_cli("run", "-q", "--no-verify", "--out", "out", "train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for label in ("a", "b"):
        log = (tmp_path / "out" / "latest" / f"run-{label}.log").read_text()
        assert plain.strip() in log, log


_GRACEFUL = """
import pathlib, signal, sys, time
import torch
stop = [False]
def on_signal(signum, frame):
    stop[0] = True  # finish this step, save, exit 0: the preemption idiom
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(200):
    if stop[0]:
        print("stopped cleanly, checkpoint saved")
        sys.exit(0)
    loss = model(torch.ones(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    pathlib.Path("started").touch()
    time.sleep(0.5)
"""


@pytest.mark.e2e
def test_a_script_ending_cleanly_on_sigterm_is_not_killed(tmp_path: Path) -> None:
    """Faults round 11: nondet, sent SIGTERM, passed it on; the script finished its step and
    exited 0, then waited to be let go by nondet, which was waiting for it to end: it was
    SIGKILLed 15 s later (exit code -9, its capture 'complete')."""
    import signal
    import subprocess
    import sys
    import time

    import h5py

    (tmp_path / "train.py").write_text(_GRACEFUL)
    nondet = subprocess.Popen([sys.executable, "-m", "nondet", "run", "-q", "--no-verify",
                               "--out", "out", "train.py"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3.0)  # a few steps in
    nondet.send_signal(signal.SIGTERM)
    _, err = nondet.communicate(timeout=120)
    assert nondet.returncode == 143, err
    for label in ("a", "b"):
        with h5py.File(tmp_path / "out" / "latest" / f"run-{label}.h5", "r") as capture:
            ended = (str(capture.attrs["status"]), int(capture.attrs["exit_code"]))
        assert ended in (("complete", 0), ("stopped", 0), ("interrupted", 130)), ended


_EXPORTED = """
import torch
from torch.export import Dim, export
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
batch = Dim("batch", min=2, max=1024)
trained = export(model, (torch.randn(8, 12),), dynamic_shapes=({0: batch},)).module()
opt = torch.optim.SGD(trained.parameters(), lr=0.05)
for step in range(4):
    x = torch.randn(16 + 8 * (step % 2), 12)
    loss = trained(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.e2e
def test_a_model_exported_with_a_dynamic_dimension_trains_under_nondet(tmp_path: Path) -> None:
    """Trial (PyTorch round 14): ``torch.export`` with a dynamic batch dimension failed
    under nondet only ("Constraints violated"): the op recorder read the fake tensors'
    symbolic sizes as integers, which fixed the dimension. Fake tensors are not recorded."""
    (tmp_path / "train.py").write_text(_EXPORTED)
    done = run_cli("run", "-q", "--no-verify", "--out", str(tmp_path / "out"), "--ops", "all",
                   "train.py", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
