"""Faults, thirteenth round (FINDINGS.md), and items left by the twelfth."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli, tiny_training


def test_a_script_that_closed_its_standard_streams_is_named_by_its_exception(
        tmp_path: Path) -> None:
    """Left by faults round 12: a script that closes file descriptors 0-2 (a daemonizing
    helper, a logger taking over the streams) and then raises was reported as "the script
    failed in run a (exit code 1)" with no exception line: nondet's own write of the
    traceback to the closed stderr raised, and the run never sent how it ended."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training() + "import os, sys\n"
                      "sys.stdout.flush(); sys.stderr.flush()\n"
                      "os.close(0); os.close(1); os.close(2)\n"
                      "raise ValueError('bad config value')\n")
    result = run_cli("run", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    error = next(line for line in result.stderr.splitlines() if line.startswith("nondet: error"))
    assert "ValueError: bad config value" in error, error


def test_a_script_that_set_stderr_to_none_is_named_by_its_exception(tmp_path: Path) -> None:
    """The same with ``sys.stderr = None`` (what pythonw and some daemons leave)."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training() + "import sys\nsys.stderr = None\n"
                      "raise KeyError('missing_column')\n")
    result = run_cli("run", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    error = next(line for line in result.stderr.splitlines() if line.startswith("nondet: error"))
    assert "KeyError: 'missing_column'" in error, error


def test_a_script_that_closed_stderr_and_exits_with_a_message_fails_with_it(
        tmp_path: Path) -> None:
    """``sys.exit("message")`` after closing stderr: Python prints the message (nowhere)
    and exits 1; nondet's print raised in the run instead, which ended without saying how
    (its last rows unsent) and showed Python's "lost sys.stderr" dump as the script's."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training() + "import sys\nsys.stderr.close()\n"
                      "sys.exit('no checkpoint found')\n")
    result = run_cli("run", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    error = next(line for line in result.stderr.splitlines() if line.startswith("nondet: error"))
    assert "exit code 1" in error and "nondet's" not in error, error
    assert "closed file" not in result.stderr and "lost sys.stderr" not in result.stderr, \
        result.stderr


def test_a_columns_value_that_is_no_width_is_ignored(tmp_path: Path) -> None:
    """Faults round 13: ``COLUMNS=abc`` ended every command with exit 3 before anything ran;
    ``COLUMNS=0`` with piped output printed nothing at all."""
    for columns in ("abc", "0", "-5", "80x"):
        result = run_cli("fixes", cwd=tmp_path, env={"COLUMNS": columns}, timeout=120)
        assert result.returncode == 0, (columns, result.stderr)
        assert "torch.deterministic" in result.stdout, (columns, result.stdout[:300])


def test_odd_values_a_script_hands_to_nondet_and_its_seeding_calls(tmp_path: Path) -> None:
    """Faults round 13, exit 3 for values a script passes: a seed over 4300 digits (Python's
    str() of it raises), a probe named by a number."""
    script = tmp_path / "train.py"
    script.write_text("import random\nimport numpy as np\nimport nondet\n"
                      "random.seed(10**5000)\nnp.random.default_rng(10**5000)\n"
                      + tiny_training() + "    nondet.probe(loss, 123)\n")
    result = run_cli("run", "--no-verify", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "deterministic" in result.stdout, result.stdout


def test_the_scripts_module_stays_main_for_its_exit_functions(tmp_path: Path) -> None:
    """Faults round 13: ``runpy`` put nondet's module back as ``__main__`` when the script's
    code returned, so an ``atexit`` function pickling a class the script defined failed
    (``torch.save(model)`` left a truncated checkpoint; nondet said "deterministic"), and
    ``__builtins__`` was a dict where ``python train.py`` has the module."""
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, pickle\n"
        "class Config:\n"
        "    lr = 0.1\n"
        "setattr(__builtins__, 'DEBUG_FLAG', True)\n"
        + tiny_training() +
        "def save():\n"
        "    with open('config.pkl', 'wb') as f:\n"
        "        pickle.dump(Config(), f)\n"
        "atexit.register(save)\n")
    result = run_cli("run", "--no-verify", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "config.pkl").stat().st_size > 20
    logs = list((tmp_path / ".nondet").glob("*/run-a.log"))
    assert logs and "Error" not in logs[0].read_text(), logs


def test_hdf5_driver_in_the_environment_is_the_scripts_not_nondets(tmp_path: Path) -> None:
    """Faults round 13: ``HDF5_DRIVER=family`` (meant for the user's own HDF5 files) made
    nondet's capture ``run-a-000000.h5`` and exit 3; ``diff`` then called good captures
    damaged. Captures are plain files whatever the variable says."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training())
    env = {"HDF5_DRIVER": "family"}
    result = run_cli("run", "--no-verify", str(script), cwd=tmp_path, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    captures = sorted(c for c in (tmp_path / ".nondet").glob("*/run-*.h5")
                      if c.parent.name != "latest")  # (run-a-000000.h5 with the driver's)
    assert [c.name for c in captures] == ["run-a.h5", "run-b.h5"], captures
    again = run_cli("diff", *map(str, captures), cwd=tmp_path, timeout=120, env=env)
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_script_that_replaces_the_os_functions_nondet_uses_is_still_recorded(
        tmp_path: Path) -> None:
    """Faults round 13: a sandbox's ``os.fstat`` refusing descriptors above 2 made nondet's
    pipe guard lose the run's pipe: "no training step was observed", the script blamed; with
    ``os.fstat = None`` the run failed inside nondet's code. nondet's run code now calls the
    functions ``os`` and ``select`` had before the script ran."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, select\n"
        "real_fstat = os.fstat\n"
        "def sandboxed(fd, *args, **kwargs):\n"
        "    if isinstance(fd, int) and fd > 2:\n"
        "        raise OSError(9, 'sandboxed fstat')\n"
        "    return real_fstat(fd, *args, **kwargs)\n"
        "def refused(*args, **kwargs):\n"
        "    raise OSError(1, 'refused by the sandbox')\n"
        "os.fstat = sandboxed\n"
        "os.write = lambda fd, data: len(data)  # swallowed\n"
        "os.read = os.dup = select.select = refused\n"
        + tiny_training(steps=3))
    result = run_cli("run", "--no-verify", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "deterministic — 2 runs (3, 3 steps)" in result.stdout, result.stdout


def test_an_empty_module_name_or_a_script_from_stdin_is_a_usage_error(tmp_path: Path) -> None:
    """Faults round 13: ``nondet run -m '' base.py`` ran base.py; ``nondet run -`` said
    "no such option: -" (python reads the script from stdin there)."""
    script = tmp_path / "base.py"
    script.write_text("raise SystemExit('must not run')\n")
    for args, said in ((("-m", "", str(script)), "-m needs a module name"),
                       (("-",), "cannot read the script from standard input")):
        for command in ("run", "check"):
            result = run_cli(command, *args, cwd=tmp_path, timeout=60)
            assert result.returncode == 2 and said in result.stderr, (command, result.stderr)
            assert not (tmp_path / ".nondet").exists()  # refused before anything ran


def test_a_scripts_traceback_shows_none_of_nondets_frames(tmp_path: Path) -> None:
    """TensorFlow round 13: a script's error passing through nondet's wrappers (a Keras
    layer's call, ``torch.autograd.backward``) showed nondet's frames between the script's
    own, read as nondet failing. Here the common ``backward()`` on a detached loss."""
    script = tmp_path / "train.py"
    script.write_text(tiny_training(steps=2) + "try:\n"
                      "    model(torch.ones(1, 8)).sum().detach().backward()\n"
                      "except RuntimeError as exc:\n"
                      "    raise ValueError('the loss lost its graph') from exc\n")
    result = run_cli("run", "--no-verify", str(script), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    log = next((tmp_path / ".nondet").glob("*/run-a.log")).read_text()
    assert "does not require grad" in log and "the loss lost its graph" in log, log
    assert "torch/autograd" in log  # torch's own frames stay, as plain Python shows them
    assert "nondet" not in log.replace(str(tmp_path), ""), log
