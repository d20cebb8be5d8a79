"""A run nondet stops leaves without Python's finalization, which can hang (a tf.data
iterator stopped mid-epoch with a ``numpy_function`` in flight waits for a thread that
needs the GIL: the ``string_ids`` fixture took 4.5 min for 40 s of CPU)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.conftest import run_cli

HANGS_WHEN_FREED_MID_TRAINING = """
    import atexit
    import os
    import time

    import numpy as np
    import torch


    class Feed:
        # Like that iterator: freed before the epoch ended, it waits for ever, Ctrl-C or not.
        done = False

        def __del__(self):
            while not self.done:
                try:
                    time.sleep(0.1)
                except KeyboardInterrupt:
                    pass


    def goodbye():
        with open(f"atexit-{os.getpid()}.txt", "w") as file:
            file.write("ran")


    atexit.register(goodbye)
    log = open(f"log-{os.getpid()}.txt", "w")  # never closed: finalization flushed it
    feed = Feed()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    noise = np.random.default_rng()  # unseeded: the runs differ from step 0
    for step in range(40):
        x = torch.from_numpy(noise.normal(size=(8, 4)).astype("float32"))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, float(loss), file=log)
    feed.done = True
    """


def test_a_stopped_run_exits_without_finalization_but_runs_atexit(tmp_path: Path) -> None:
    """Both runs are stopped a few steps after step 0 differs. Each ran its script's
    ``atexit`` function, wrote out the file it never closed, and exited at once; before,
    each hung in finalization until nondet ended it two minutes later (over four minutes
    in all, past this test's limit)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HANGS_WHEN_FREED_MID_TRAINING))
    try:
        result = run_cli("run", "-q", "--no-verify", "--json", "r.json", str(script),
                         cwd=tmp_path, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("nondet waited for stopped runs that hung at exit")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_divergence"]["step"] == 0
    assert [run["status"] for run in report["runs"]] == ["stopped", "stopped"], report["runs"]
    assert [run["exit_code"] for run in report["runs"]] == [0, 0], report["runs"]
    assert len(list(tmp_path.glob("atexit-*.txt"))) == 2
    logs = sorted(tmp_path.glob("log-*.txt"))
    assert len(logs) == 2 and all(log.read_text().startswith("0 ") for log in logs), \
        [log.read_text() for log in logs]
