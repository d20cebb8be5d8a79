"""Shared test helpers: synthetic captures written with the real store, and CLI runners."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nondet.records import OP_DTYPE, STEP_DTYPE, TENSOR_DTYPE, Kind, Phase
from nondet.session import SourceLocator
from nondet.store import SOURCE_TEXT_MARK, CaptureWriter

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"


@pytest.fixture(autouse=True)
def _plain_console(monkeypatch: pytest.MonkeyPatch) -> None:
    # Deterministic rendering: no colour, fixed width (as hatch's tests do).
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("TERM", "dumb")


class OpStream:
    """Builds op records the way a capture stores them, with a string table."""

    def __init__(self) -> None:
        self.strings: list[str] = []
        self.rows: list[tuple[Any, ...]] = []

    def sid(self, text: str) -> int:
        if text not in self.strings:
            self.strings.append(text)
        return self.strings.index(text)

    def add(self, step: int, name: str, out: int, inputs: int = 0, *, kind: Kind = Kind.OP,
            phase: Phase = Phase.FORWARD, flags: int = 0, module: str = "", source: str = "",
            taint: int = 0, scalars: int = 0, numel: int = 4) -> OpStream:
        index = sum(1 for r in self.rows if r[0] == step)
        self.rows.append((step, index, int(kind), int(phase), flags, self.sid(name),
                          self.sid(module), self.sid(source) if source else -1, out, inputs,
                          taint, scalars, numel))
        return self

    def array(self, step: int | None = None) -> np.ndarray:
        rows = [r for r in self.rows if step is None or r[0] == step]
        return np.array(rows, dtype=OP_DTYPE)


def step_rows(*specs: dict[str, Any]) -> np.ndarray:
    rows = np.zeros(len(specs), dtype=STEP_DTYPE)
    rows["loss"] = np.nan
    for i, spec in enumerate(specs):
        for key, value in spec.items():
            rows[i][key] = value
    return rows


def write_capture(path: Path, steps: np.ndarray, ops: OpStream | None = None,
                  env: dict[str, str] | None = None, facts: dict[str, Any] | None = None,
                  status: str = "complete", attrs: dict[str, Any] | None = None,
                  dumps: dict[str, np.ndarray] | None = None,
                  tensors: list[tuple[Any, ...]] | None = None) -> Path:
    """A capture as a run writes it; ``tensors``: per-tensor step rows
    ``(step, group, name, fp, sum, maxabs, numel)`` (names interned here)."""
    writer = CaptureWriter(path, {"label": path.stem, "cwd": str(path.parent), "seed": 0,
                                  "op_steps": [-1, 0], **(attrs or {})})
    writer.add_env({"torch_version": "2.13.0", "python_version": "3.11.7", **(env or {})})
    if facts:
        writer.add_facts(facts)
    if ops is not None:
        writer.add_strings(ops.strings + source_texts(ops.strings, path.parent))
        for step in sorted({r[0] for r in ops.rows}):
            writer.add_ops(ops.array(step))
    if tensors:
        known = len(ops.strings) + len(source_texts(ops.strings, path.parent)) if ops else 0
        names = list(dict.fromkeys(str(t[2]) for t in tensors))
        writer.add_strings(names)
        writer.add_tensors(np.array([(t[0], int(t[1]), known + names.index(str(t[2])), *t[3:])
                                     for t in tensors], dtype=TENSOR_DTYPE))
    for i in range(len(steps)):
        writer.add_step(steps[i : i + 1])
    for name, array in (dumps or {}).items():
        writer.add_dump(name, array, {})
    writer.close(status, 0)
    return path


def source_texts(strings: list[str], cwd: Path) -> list[str]:
    """The source-text entries a real run adds for its "file:line" strings (files in cwd;
    tests that craft other paths must not get their files' text this way)."""
    out = []
    for s in strings:
        file, _, line = s.rpartition(":")
        inside = not Path(file).is_absolute() and ".." not in Path(file).parts
        if file and line.isdigit() and inside and (cwd / file).is_file():
            text = SourceLocator.source_line(str(cwd / file), int(line))
            out.append(f"{SOURCE_TEXT_MARK}{s}\n{text}")
    return out


def tiny_training(steps: int = 4) -> str:
    """A script's lines that seed torch and train a linear model for ``steps`` steps: what
    the tests' own scripts wrap in the behaviour they are about."""
    return ("import torch\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Linear(8, 2)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            f"for step in range({steps}):\n"
            "    loss = model(torch.randn(4, 8)).pow(2).mean()\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n")


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the real ``nondet`` command in a subprocess (as a user would)."""
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100", **(env or {})}
    return subprocess.run([sys.executable, "-m", "nondet", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def lines_of(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


def first(items: Iterable[Any]) -> Any:
    return next(iter(items))
