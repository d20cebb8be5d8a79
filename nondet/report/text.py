"""Human-readable report: the verdict first, then the finding, its context, the fix."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from rich.markup import escape

from nondet.fingerprint import short
from nondet.printable import clip
from nondet.printable import printable as printable  # re-exported: its users import it here
from nondet.report import STATE_PARTS, Divergence, GrowthRow, Report
from nondet.report import seed_verb as got

if TYPE_CHECKING:
    from rich.console import Console

    from nondet.recipe import Suggestion

_LABEL = 10  # width of the left-hand labels

def _clipped(div: Divergence) -> Divergence:
    """``div`` with every name from the capture clipped (the JSON report keeps them whole)."""
    def maybe(text: str | None) -> str | None:
        return None if text is None else clip(text)

    context = [replace(c, op=clip(c.op), module=clip(c.module), source=clip(c.source))
               for c in div.context]
    return replace(div, op=maybe(div.op), node=maybe(div.node), module=maybe(div.module),
                   source=maybe(div.source), process=maybe(div.process),
                   op_b=maybe(div.op_b), context=context)


def render(report: Report, console: Console) -> None:
    for line in lines(report):
        console.print(line, highlight=False, soft_wrap=True)


def lines(report: Report) -> list[str]:
    """The report as rich-markup lines (tests compare them with markup stripped); every
    string in them that came from a capture is escaped, made printable and clipped."""
    if report.first_divergence is not None or report.sources:
        report = replace(report, first_divergence=report.first_divergence and _clipped(
            report.first_divergence), sources=[replace(x, first_divergence=_clipped(
                x.first_divergence)) for x in report.sources])
    out = [_verdict(report)]
    div = report.first_divergence
    if report.baseline:
        out += ["", _row("baseline", escape(f"{report.baseline} (one run compared with it)"))]
    if report.environment_differences:  # first: they may explain everything below
        out += ["", *_environment(report)]
    if report.repeatability:
        out += ["", *_repeatability(report)]
    if div is not None:
        out += ["", *_finding(div)]
        if div.context:
            out += ["", *_context(div)]
    if report.suggestions:
        out += ["", *_suggestions(report)]
    if report.growth and div is not None:
        out += ["", *_growth(report)]
    if report.combined_fix is not None:
        out += ["", *_sources(report)]
    notes = [*(div.notes if div else []), *report.notes]
    if notes:
        out += [""] + [_row("note" if i == 0 else "", escape(n)) for i, n in enumerate(notes)]
    if report.captures:
        out += ["", _row("captures", escape("  ".join(report.captures)))]
    return [printable(line) for line in out]


#: How a run ended that leaves its steps short of the script's end (``channel``'s statuses).
_CUT_SHORT = ("interrupted", "crashed", "failed")


def _verdict(report: Report) -> str:
    div = report.first_divergence
    if div is None:
        steps = ", ".join(str(r.steps) for r in report.runs)
        detail = f"{len(report.runs)} runs ({steps} steps) are bitwise identical"
        if report.contained:  # something differed that reached no training state (a note)
            detail = (f"{len(report.runs)} runs ({steps} steps) trained bitwise identically "
                      "(a difference that never reached training is noted below)")
        # `nondet diff` of what a Ctrl-C, a crash or a failure left: identical so far, not
        # to the end (a crashed run's capture read "bitwise identical" without a word)
        ended: dict[str, list[str]] = {}
        for r in report.runs:
            if r.status in _CUT_SHORT:
                ended.setdefault(r.status, []).append(escape(r.label or r.path))
        cut = [f"{status}: {', '.join(labels)}" for status, labels in ended.items()]
        if cut:
            detail += (f" over the steps both recorded ({'; '.join(cut)}; what came after "
                       "was not compared)")
        if report.op_records:
            detail += f", {report.op_records:,} op records compared"
        return f"[bold green]nondet: deterministic[/] — {detail}"
    where = "init" if div.step is None else f"step {div.step}"
    what = {
        "op": f"{escape(div.op or '?')} creates the difference",
        "entry": f"{escape(_entry_label(div))} enters with different values",
        "structure": "the runs execute different ops",
        "init": "the initial state already differs",
        "seed": f"{escape(div.op or 'a seeding call')} {got(div.op or '')} a different seed",
        "collective": f"the collective {escape(div.op or '?')} creates the difference: its "
                      "output differs while every rank's inputs matched"
                      + (f" ({escape(str(div.collective['summary']))})"
                         if div.collective and div.collective.get("summary") else ""),
        "desync": "a replica's parameters drift from rank 0's",
    }.get(div.kind, "the runs differ")
    if div.kind == "structure" and div.op_index is None:
        what = "one run ended, the other went on"  # a different number of steps
    elif not div.localized:
        what = f"runs diverge ({escape(div.phase)})"
    rank = f", rank {div.rank}" if div.world_size > 1 else ""
    # "init, init" and "step 0, other" say nothing the place does not: the phase is shown
    # where it names one (forward, backward, optimizer, data)
    phase = f", {escape(div.phase)}" if div.phase and div.phase not in (where, "other") else ""
    return f"[bold red]nondet: nondeterministic[/] — {where}{phase}{rank}: {what}"


def _executed(op: str | None) -> str:
    """What one run did at a record where the runs' op streams part (None: its ops ended)."""
    return "recorded no more ops" if op is None else f"executed {escape(op)}"


def _entry_label(div: Divergence) -> str:
    if div.entry_kind == "dataloader":
        return "a DataLoader batch"
    if div.entry_kind == "numpy":
        return f"a tensor made from NumPy ({div.op})"
    if div.entry_kind == "python_value":
        return f"a Python value ({div.op})"
    return div.op or "a tensor"


def _finding(div: Divergence) -> list[str]:
    out = []
    step = "init" if div.step is None else f"step {div.step}"
    if div.kind == "op" and div.localized:
        head = f"{step}, {escape(div.phase)}, op #{div.op_index}: [bold]{escape(div.op or '')}[/]"
        if div.node:
            head += f" at node {escape(div.node)}"
        why = ("its output differs while all its inputs matched: this op created the difference"
               if div.explained else "its output differs; its inputs differed too, but no "
               "earlier recorded op did")
        if div.reads_uninitialized:
            why = "it reads uninitialized memory (torch.empty & co.) and its output differs"
        out += [_row("finding", head), _row("", why)]
    elif div.kind == "entry":
        record = f", record #{div.op_index}" if div.op_index is not None else ""
        phase = "" if div.phase == step else f", {escape(div.phase)}"  # not "init, init"
        out += [_row("finding", f"{step}{phase}{record}: "
                                f"[bold]{escape(_entry_label(div))}[/]"),
                _row("", "this value came from outside the recorded ops and differs between "
                         "runs")]
    elif div.kind == "seed":
        out += [_row("finding", f"{step}: [bold]{escape(div.op or '')}[/] was called with "
                                "a different seed in each run"),
                _row("", "every value drawn from what it seeds differs from here on")]
    elif div.kind == "collective":
        out += [_row("finding", f"{step}, comm, op #{div.op_index}: [bold]"
                                f"{escape(div.op or '')}[/]"),
                _row("", "its output differs while every rank's inputs matched: the "
                         "collective created the difference (arrival or reduction order)")]
        if div.collective and div.collective.get("summary"):
            read = div.collective.get("output_read") or ""
            out.append(_row("", escape(str(div.collective["summary"]))
                            + (f"; output {escape(str(read))}" if read else "")))
    elif div.kind == "desync":
        out += [_row("finding", f"{step}: rank {div.rank}'s parameters differ from rank 0's "
                                "(replica desync within one run)")]
    elif div.kind == "structure" and div.op_index is None:
        out += [_row("finding", f"{step}: only one run got here (the note says which)")]
    elif div.kind == "structure":
        out += [_row("finding", f"{step}, record #{div.op_index}: run a "
                                f"{_executed(div.op)}, run b {_executed(div.op_b)}")]
    else:
        fields = ", ".join(div.step_fields) or "state"
        out += [_row("finding", f"{step}, {escape(div.phase)}: {escape(fields)} differ"),
                _row("", "no op-level recording covers this step")]
    if div.process:
        out.append(_row("process", f"{escape(div.process)} (a process the script started)"))
    if div.world_size > 1:
        out.append(_row("rank", f"{div.rank} of {div.world_size}"))
    if div.module:
        out.append(_row("module", escape(div.module)))
    if div.source:
        code = f"    {escape(div.source_text)}" if div.source_text else ""
        out.append(_row("source", f"{escape(div.source)}{code}"))
    if div.mismatched_elements is not None and div.numel:
        pct = 100.0 * div.mismatched_elements / div.numel
        size = f"{div.mismatched_elements:,} of {div.numel:,} elements ({pct:.1f}%)"
        if div.max_abs_diff is not None and div.mismatched_elements:
            at = f" at {tuple(div.max_abs_diff_at)}" if div.max_abs_diff_at else ""
            size += f"; greatest |a-b| {_num(div.max_abs_diff)}{at}"
        out.append(_row("differs", size))
    return out


def _context(div: Divergence) -> list[str]:
    width_op = max(len(c.op) for c in div.context)
    width_mod = max(len(c.module) for c in div.context)
    width_src = max(len(c.source) for c in div.context)
    out = []
    for i, c in enumerate(div.context):
        mark = ">" if c.focus else " "
        text = (f"{mark} #{c.index:<5} {c.op:<{width_op}}  {c.module:<{width_mod}}  "
                f"{c.source:<{width_src}}  {c.state}")
        out.append(_row("context" if i == 0 else "", escape(text.rstrip())))
    return out


def _suggestions(report: Report) -> list[str]:
    first, *rest = report.suggestions
    r = first.recipe
    out = [_row("cause", f"[{escape(r.id)}] {escape(r.cause)}"),
           _row("fix", f"[bold]{escape(first.fix)}[/]")]
    info = [x for x in (r.where, f"applies to {first.applies}" if first.applies else "",
                        f"cost: {r.cost}" if r.cost else "") if x]
    if first.applies_here is False:
        info.append("not for the installed version")
    if info:
        out.append(_row("", escape("; ".join(info))))
    if first.verified is not None or first.verify_note:
        out.append(_row("", escape(_verification(first))))
    for detail in first.details:
        out.append(_row("", escape(detail)))
    if r.sources:
        out.append(_row("", escape(r.sources[0])))
    for i, s in enumerate(rest):
        out.append(_row("also" if i == 0 else "",
                        f"[{escape(s.recipe.id)}] {escape(s.recipe.title)}: {escape(s.fix)}"
                        + (f" ({escape(_verification(s))})" if s.verified is not None else "")))
    return out


def _sources(report: Report) -> list[str]:
    """Every source in order with its verified fix, then the combined fix."""
    out = []
    for n, source in enumerate(report.sources, start=1):
        d = source.first_divergence
        where = "init" if d.step is None else f"step {d.step}"
        what = d.op or ", ".join(d.step_fields) or d.kind
        line = f"{n}. {where} ({d.phase}): {what}"
        line += (f" at {d.source}" if d.source else "") + (f" in {d.module}" if d.module else "")
        out.append(_row("sources" if n == 1 else "", escape(line)))
        fix = source.fix
        if fix is not None:
            out.append(_row("", escape(f"   [{fix.recipe.id}] {fix.fix} ({_verification(fix)})")))
        elif source.suggestions:
            first = source.suggestions[0]
            why = f": {first.verify_note}" if first.verify_note else ""
            out.append(_row("", escape(f"   [{first.recipe.id}] {first.fix} (no fix verified"
                                       f"{why})")))
    combined = report.combined_fix
    assert combined is not None
    lines = [f"{k}={v}" for k, v in combined.env.items()] + combined.code
    for i, text in enumerate(lines):
        out.append(_row("all fixes" if i == 0 else "", f"[bold]{escape(text)}[/]"))
    # a torchrun job's runs are its ranks' captures ("a/rank0"): count the jobs
    jobs = {r.label.split("/")[0] for r in report.runs if "/rank" in r.label}
    runs = len(jobs) or len(report.runs)
    if combined.verified:
        cost = f", step time {combined.cost_ratio:.2f}x" if combined.cost_ratio else ""
        out.append(_row("", f"with all of these, {runs} runs repeat over "
                            f"{combined.verified_steps} steps{cost}"))
    if combined.note:
        out.append(_row("", escape(combined.note)))
    return out


def _verification(s: Suggestion) -> str:
    """'verified: the runs repeat over 4 steps with ...; cost 1.07x step time'."""
    if s.verified:
        cost = f"; cost {s.cost_ratio:.2f}x step time" if s.cost_ratio else ""
        return f"verified: {s.verify_note.removeprefix('verified ')}{cost}"
    if s.verified is False:
        return f"not verified: {s.verify_note}"
    return s.verify_note


def _environment(report: Report) -> list[str]:
    out = []
    for i, d in enumerate(report.environment_differences[:20]):
        out.append(_row("env diff" if i == 0 else "",
                        escape(f"{d['key']}: a={d['a']}  b={d['b']}")))
    hidden = len(report.environment_differences) - 20
    if hidden > 0:
        out.append(_row("", f"... and {hidden} more (see --json)"))
    return out


def _repeatability(report: Report) -> list[str]:
    rows = report.repeatability
    out = [_row("runs", "run    steps  final loss        weights       outcome")]
    for r in rows:
        ended = "" if r.status in ("complete", "stopped") else f" ({r.status})"
        out.append(_row("", escape(f"{r.label:<6} {r.steps:<6} {_num(r.final_loss):<17} "
                                   f"{short(r.digest):<13} {r.outcome}{ended}")))
    distinct = len({r.outcome for r in rows})
    out.append(_row("", f"{distinct} distinct outcome{'s' if distinct != 1 else ''} in "
                        f"{len(rows)} runs"))
    return out


#: Rows of the terminal's growth table (the JSON and HTML reports have every step).
GROWTH_ROWS = 6


def _growth(report: Report) -> list[str]:
    rows = report.growth
    start = next((i for i, g in enumerate(rows) if g.differing), 0)
    out = [_row("growth", "step   loss a           loss b           |Δ loss|    "
                          "largest |Δ| (log)     differs in")]
    for g in rows[start:start + GROWTH_ROWS]:
        out.append(_row("", escape(
            f"{g.step:<6} {_num(g.loss_a):<16} {_num(g.loss_b):<16} {_num(g.loss_abs_diff, 4):<11} "
            f"{_magnitude(g):<21} {', '.join(g.differing) or '-'}")))
    return out


def _magnitude(g: GrowthRow) -> str:
    """A bar, one block per two decades from 1e-16, and the largest difference known at
    this step (loss or state). '≥' when a part differs by an amount only bounded from below,
    '> 0' when not even a bound is known, '?' when nothing was recorded."""
    parts = [g.state(p) for p, _ in STATE_PARTS]
    exact = [x for x in (g.loss_abs_diff, *(d.max_abs_diff for d in parts)) if x is not None]
    bounds = [d.max_abs_diff_min for d in parts if d.max_abs_diff_min is not None]
    inexact = any(d.differs and d.max_abs_diff is None for d in parts)
    if not exact and not bounds and not inexact:
        return "?"
    value = max(exact + bounds, default=0.0)
    if value == 0:
        return "> 0" if inexact else "·"
    blocks = max(1, min(8, math.ceil((math.log10(value) + 16) / 2)))
    return f"{'█' * blocks:<8} {'≥' if inexact else ''}{_num(value, 4)}"


def _row(label: str, text: str) -> str:
    return f"  {label:<{_LABEL}}{text}"


def _num(value: float | None, digits: int = 9) -> str:
    """A number for a table cell: ``digits`` significant digits (differences take 4, to
    fit their column: faults round 12), a power of ten outside 1e-3 to 1e4."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.3e}"
    return f"{value:.{digits}g}"
