"""``nondet show``: what a capture holds, as tables."""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from nondet.cli._common import App
from nondet.exitcodes import EPILOG

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

    from nondet.store import Capture


@click.command(epilog=EPILOG)
@click.argument("capture", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--steps", "max_steps", default=20, show_default=True,
              type=click.IntRange(min=2),
              help="Show at most this many step rows (first and last ones; at least 2).")
@click.option("--ops", "op_step", type=int, metavar="STEP",
              help="List the op records of this step (-1 for init).")
@click.pass_obj
def show(app: App, *, capture: Path, max_steps: int, op_step: int | None) -> int:
    """Show a capture: run, environment, steps with fingerprints, op records."""
    from rich.table import Table
    from rich.text import Text

    from nondet.fingerprint import short
    from nondet.records import Kind, Phase, split_node
    from nondet.report.text import printable
    from nondet.store import open_capture

    def cell(value: object) -> Text:
        # Strings from the file are text: no markup interpreted, no control characters.
        return Text(printable(str(value)))

    c = open_capture(capture)
    c.verify()  # a damaged file is exit 2, not a table of whatever it now holds
    out = app.out
    info = Table(title=cell(capture), show_header=False, box=None)
    for key in ("label", "status", "exit_code", "steps", "command", "script", "module", "seed",
                "started", "op_steps", "rank", "world_size", "nondet_format_version",
                "nondet_version"):
        if key in ("rank", "world_size") and int(c.attrs.get("world_size", 1)) <= 1:
            continue  # one process: nothing to say
        if key == "status":
            info.add_row(key, cell(c.status + (" (its writer was killed: read up to the last "
                                               "step it flushed)" if c.unclosed else "")))
        elif key in c.attrs and c.attrs[key] != "":
            info.add_row(key, cell(c.attrs[key]))
    out.print(info)

    env = Table(title="environment", show_header=False, box=None)
    for key, value in sorted(c.env.items()):
        if not (key.startswith("env.") and value == "(unset)"):
            env.add_row(cell(key), cell(value))
    out.print(env)

    steps = Table(title=f"steps ({c.n_steps}, plus init)")
    for column in ("step", "loss", "data", "loss fp", "grads", "params", "buffers", "optim",
                   "rng", "ops"):
        steps.add_column(column, justify="right" if column in ("step", "loss", "ops") else "left")
    rows = list(c.steps)
    if len(rows) > max_steps:
        half = max_steps // 2
        rows = [*rows[:half], None, *rows[-half:]]
    for r in rows:
        if r is None:
            steps.add_row("...", *[""] * 9)
            continue
        step = int(r["step"])
        steps.add_row("init" if step < 0 else str(step), f"{float(r['loss']):.6g}",
                      *(short(int(r[f]))[:8] for f in ("data_fp", "loss_fp", "grads_fp",
                                                    "params_fp", "buffers_fp", "optim_fp",
                                                    "rng_fp")),
                      str(int(r["n_records"])))
    out.print(steps)

    op_steps = c.op_steps()
    if op_steps:
        summary = Table(title="op records per step")
        summary.add_column("step", justify="right")
        summary.add_column("records", justify="right")
        summary.add_column("most frequent ops")
        for s in op_steps:
            ops = c.ops(s)
            counts = collections.Counter(split_node(c.string(int(n)))[0] for n in ops["name"])
            common = ", ".join(f"{name} ({n})" for name, n in counts.most_common(4))
            summary.add_row("init" if s < 0 else str(s), str(len(ops)), cell(common))
        out.print(summary)
    if op_step is not None:
        ops = c.ops(op_step)
        if not len(ops):
            raise click.UsageError(f"no op records for step {op_step}; steps with op records: "
                                   f"{op_steps or 'none'}")
        table = Table(title=f"op records of step {op_step}")
        names = [split_node(c.string(int(r["name"]))) for r in ops]
        with_nodes = any(node for _, node in names)  # TensorFlow graph ops
        for column in ("#", "kind", "phase", "op", "node", "module", "source", "out", "in"):
            if column != "node" or with_nodes:
                table.add_column(column)
        for r, (op, node) in zip(ops, names, strict=True):
            table.add_row(str(int(r["index"])), Kind(int(r["kind"])).name.lower(),
                          Phase(int(r["phase"])).label, cell(op),
                          *([cell(node or "")] if with_nodes else []),
                          cell(c.string(int(r["module"]))), cell(c.string(int(r["source"]))),
                          short(int(r["out_fp"])), short(int(r["in_fp"])))
        out.print(table)
        _collectives(c, op_step, out, cell)
    return 0


def _collectives(c: Capture, step: int, out: Console, cell: Callable[[object], Text]) -> None:
    """What the capture's comm table holds of the step's collectives (collective.py)."""
    from rich.table import Table

    from nondet.collective import call_info

    rows = [r for r in c.comm if int(r["step"]) == step]
    if not rows:
        return
    table = Table(title=f"collectives of step {step}")
    for column in ("#", "op", "backend, group, bucket", "output"):
        table.add_column(column)
    names = {int(r["index"]): c.string(int(r["name"])) for r in c.ops(step)}
    for r in rows:
        info = call_info(c, step, int(r["index"])) or {}
        table.add_row(str(int(r["index"])), cell(names.get(int(r["index"]), "")),
                      cell(info.get("summary", "")), cell(info.get("output_read", "")))
    out.print(table)
