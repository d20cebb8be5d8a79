"""Faults, fifth round (FINDINGS.md): what a run inherits (the working directory and nondet's
own checkout on the script's import path), how a script's exit status is read, and an
optimizer given its parameters in a set's order (a false alarm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from nondet import boot


@pytest.mark.parametrize(("code", "status"), [
    (None, 0), (0, 0), (3, 3), (256, 0), (257, 1), (-1, 255), (2**31, 0), (2**100, 255),
    (True, 1)])
def test_an_exit_status_is_the_one_the_operating_system_keeps(code: object,
                                                               status: int) -> None:
    # Trial: `sys.exit(256)` ends `python script.py` with status 0; nondet said "the script
    # failed in run a (exit code 0)"
    assert boot._exit_code(SystemExit(code)) == status


def _set_ordered_optimizers() -> tuple[object, object, object]:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4),
                                torch.nn.Linear(4, 1))
    params = list(model.parameters())
    # the same optimizer over the same tensors, listed in two orders (as `list(set(...))`
    # lists them differently in two runs); one update each from the same gradients
    first = torch.optim.Adam(params, lr=0.1)
    second = torch.optim.Adam(params[::-1], lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    for opt in (first, second):
        for p in params:
            opt.state[p]["exp_avg"] = p.grad.clone()  # the same state, per parameter
    return model, first, second


def test_optimizer_state_is_ordered_by_parameter_not_by_the_optimizers_list() -> None:
    # Trial: `Adam(list(set(model.parameters())))`, deterministic (3 of 3 plain runs alike):
    # "nondeterministic — step 0, optimizer: aten.zeros_like.default creates the
    # difference" (optim_fp differed at every step: the state in the list's order)
    from nondet.frameworks.torch.state import named_state

    model, first, second = _set_ordered_optimizers()
    names = {id(p): n for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    a = named_state([model], [weakref.ref(first)], names)[2]  # type: ignore[list-item]
    b = named_state([model], [weakref.ref(second)], names)[2]  # type: ignore[list-item]
    assert [n for n, _ in a] == [n for n, _ in b]
    torch = pytest.importorskip("torch")
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True))


_PROBE = """
import json, os, sys
with open(os.path.join(os.path.dirname(__file__), "..", "seen-%d.json" % os.getpid()), "w") as f:
    json.dump({"path": sys.path, "env": [os.environ.get("PYTHONPATH"),
                                         os.environ.get("PYTHONSAFEPATH")],
               "tests": __import__("tests.util").util.WHERE}, f)
"""


def test_a_run_imports_what_python_script_py_would(tmp_path: Path) -> None:
    # Trials: `nondet run sub/train.py` from a directory holding a scratch `signal.py`:
    # "the script failed in run a: RuntimeError" raised in nondet/boot.py's `import signal`
    # (`-m nondet.boot` put the working directory first); a script importing its own
    # `tests/util.py` (no __init__.py): "No module named 'tests.util'" (nondet's checkout
    # was first on PYTHONPATH, its `tests` package won). Plain python ran both.
    (tmp_path / "signal.py").write_text("raise RuntimeError('a scratch signal.py')\n")
    (tmp_path / "sub" / "tests").mkdir(parents=True)
    (tmp_path / "sub" / "tests" / "util.py").write_text("WHERE = 'the script'\n")
    (tmp_path / "sub" / "probe.py").write_text(_PROBE)
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(tmp_path / "lib")}
    env.pop("PYTHONSAFEPATH", None)
    plain = subprocess.run([sys.executable, "sub/probe.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    want = [json.loads(p.read_text()) for p in tmp_path.glob("seen-*.json")]
    for p in tmp_path.glob("seen-*.json"):
        p.unlink()
    # -P: the nondet command's own process must not import the scratch signal.py either
    done = subprocess.run([sys.executable, "-P", "-m", "nondet", "run", "-q", "sub/probe.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    seen = [json.loads(p.read_text()) for p in tmp_path.glob("seen-*.json")]
    assert "script failed" not in done.stderr, done.stderr
    assert len(seen) == 2 and all(s == want[0] for s in seen), (seen, want, done.stderr)


def test_a_directory_with_a_main_is_a_script_as_for_python(tmp_path: Path) -> None:
    # Trial: `nondet run appdir` (appdir/__main__.py trains; `python appdir` runs it):
    # "not a script file: appdir", exit 2
    from nondet.errors import NondetError
    from nondet.importpath import script_entry
    from nondet.runspec import Target

    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("print('trains')\n")
    (tmp_path / "empty").mkdir()
    Target(str(tmp_path / "app"), None).check()
    with pytest.raises(NondetError, match="not a script file"):
        Target(str(tmp_path / "empty"), None).check()
    # runpy puts the directory itself first on sys.path, as python does; a file: its parent
    assert script_entry(str(tmp_path / "app")) is None
    assert script_entry(str(tmp_path / "app" / "__main__.py")) == str(tmp_path / "app")


def test_a_script_linked_from_elsewhere_imports_its_siblings_as_for_python(
        tmp_path: Path) -> None:
    # Trial: `nondet run linked.py`, a symlink to a script in another directory that
    # imports a module beside it: "the script failed in run a: ModuleNotFoundError", exit 2;
    # python resolves the link before putting the script's directory on sys.path.
    from nondet.importpath import script_entry

    real = tmp_path / "real dir ü"
    real.mkdir()
    (real / "helper_mod.py").write_text("VALUE = 3\n")
    (real / "train.py").write_text(
        "import torch, helper_mod\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(m.parameters(), 0.1)\n"
        "for _ in range(helper_mod.VALUE):\n"
        "    loss = m(torch.ones(1, 2)).sum(); opt.zero_grad(); loss.backward(); opt.step()\n")
    (tmp_path / "linked.py").symlink_to(real / "train.py")
    assert script_entry(str(tmp_path / "linked.py")) == str(real)
    done = subprocess.run([sys.executable, "-m", "nondet", "run", "-q", "--no-verify",
                           "linked.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_captures_whose_directory_the_script_deleted_are_said_to_be_gone(
        tmp_path: Path) -> None:
    # Trial: a script running `shutil.rmtree(".nondet")` at step 1: "nondet: error: capture
    # not found: .nondet/20261124-233231-6891/run-a.h5", as if nondet had lost it
    from nondet.errors import NondetError
    from nondet.store import open_capture

    with pytest.raises(NondetError, match=r"20261124-233231-6891 was deleted while nondet "
                                          r"ran \(by the script\?\); give --out"):
        open_capture(tmp_path / "20261124-233231-6891" / "run-a.h5")
    with pytest.raises(NondetError) as raised:  # a path the user typed: as before
        open_capture(tmp_path / "typo" / "run-a.h5")
    assert str(raised.value) == f"capture not found: {tmp_path / 'typo' / 'run-a.h5'}"


def test_a_users_random_hash_seed_ranks_the_hash_recipe_first() -> None:
    # Trial: `PYTHONHASHSEED=random nondet run` of a script whose token ids come from a set
    # of strings (nondet keeps the user's setting): found, but the first fix was
    # [PY-THIRDPARTY-RNG] cv2.setRNGSeed(...), PY-HASHSEED only under "also"
    from nondet import recipe

    entry = {"framework": "torch", "kind": "entry", "entry_kind": "python_value",
             "phase": "forward", "op": "python_value:torch.tensor"}
    salted = recipe.suggest({**entry, "python.hash_salted": True})
    assert salted[0].recipe.id == "PY-HASHSEED"
    assert recipe.suggest({**entry, "python.hash_salted": False})[0].recipe.id != "PY-HASHSEED"


_LAZY = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.ones(4, 5)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.e2e
def test_a_lazy_module_trains_under_nondet(tmp_path: Path) -> None:
    # Trial: the same script (plain python: runs) ended "nondet: internal error:
    # InternalChildError: ... Attempted to use an uninitialized parameter", exit 3 (the
    # init row, then the root's first call forgetting its parameters' fingerprints)
    pytest.importorskip("torch")
    (tmp_path / "lazy.py").write_text(_LAZY)
    done = subprocess.run([sys.executable, "-m", "nondet", "run", "-q", "--no-verify",
                           "lazy.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("args", "code"), [(["fixes"], 0), (["show", "nothere.h5"], 2)])
def test_pythoninspect_leaves_the_commands_exit_code(tmp_path: Path, args: list[str],
                                                     code: int) -> None:
    # Trial: `PYTHONINSPECT=1 nondet run base.py` (stdin closed, as in CI): "deterministic",
    # then a "SystemExit: 0" traceback and exit 1 -- "nondeterminism found"
    done = subprocess.run([sys.executable, "-m", "nondet", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL,
                          env={**os.environ, "NO_COLOR": "1", "PYTHONINSPECT": "1"})
    assert done.returncode == code and "Traceback" not in done.stderr, done.stderr


def test_a_json_report_given_as_a_capture_is_named_as_such(tmp_path: Path) -> None:
    # Trial: `nondet show report.json` (its captures since moved): "cannot read report.json:
    # not an HDF5 file or truncated (...); re-capture it with `nondet run`"
    from nondet.errors import NondetError
    from nondet.store import open_capture

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"nondet_report_version": 1, "verdict": "deterministic",
                                  "runs": [{"path": str(tmp_path / "moved" / "run-a.h5")}]}))
    with pytest.raises(NondetError, match=r"report.json is a JSON report of nondet's, not a "
                                          r"capture: `nondet report .*moved or deleted"):
        open_capture(report)
