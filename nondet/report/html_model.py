"""The HTML report's content, read from the JSON report (``Report.to_json``), whether it
was just made or loaded from a file someone saved (or crafted): every field is checked for
its type here, once, so the template only places strings and numbers. Missing or mistyped
fields show as absent, never as an error (older reports lack newer fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nondet.report import charts, snippet
from nondet.report import seed_verb as got
from nondet.report.text import printable


def _s(value: Any) -> str:
    """A string field made printable (control characters replaced; escaping is the
    template's); anything that is not a string or a number is absent."""
    if isinstance(value, bool) or value is None:
        return ""
    return printable(str(value)) if isinstance(value, (str, int, float)) else ""


def _f(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:  # a crafted report's 10**400 is no float (OverflowError)
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _i(value: Any) -> int | None:
    """An integer a capture could hold (64 bits), else absent: a crafted report's 10**400
    overflowed the percentage computed from it."""
    if isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63:
        return value
    return None


def _d(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _l(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def num(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "0"
    return f"{value:.9g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.3e}"


@dataclass
class Fix:
    id: str
    title: str
    cause: str
    fix: str
    verified: bool | None
    verification: str  # "verified over 6 steps, cost 1.07x step time", ...
    info: list[str]
    links: list[tuple[str, str]]  # (text, href or "" when not an http(s) address)


@dataclass
class Source:
    heading: str
    fixes: list[Fix]


@dataclass
class CombinedFix:
    env: list[tuple[str, str]]
    code: list[str]
    verification: str
    verified: bool | None


@dataclass
class View:
    verdict: str
    headline: str
    exit_code: int | None
    command: str
    runs: list[dict[str, str]]
    finding: list[tuple[str, str]] = field(default_factory=list)
    op: str = ""
    source: str = ""
    source_text: str = ""
    snippet: list[snippet.SnippetLine] = field(default_factory=list)
    context: list[dict[str, str]] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    combined_fix: CombinedFix | None = None
    growth_chart: str = ""
    fraction_chart: str = ""
    growth_rows: list[list[str]] = field(default_factory=list)
    first_step: int | None = None
    repeat_rows: list[dict[str, str]] = field(default_factory=list)
    distinct: int | None = None
    outcome_chart: str = ""
    environment_differences: list[tuple[str, str, str]] = field(default_factory=list)
    environment: list[tuple[str, str]] = field(default_factory=list)
    unset: list[str] = field(default_factory=list)  # variables that were not set
    notes: list[str] = field(default_factory=list)
    captures: list[str] = field(default_factory=list)
    baseline: str = ""


#: A run's fields the page shows: each present, "" where a crafted report lacks it (a run
#: given as a string, null, or {} ended the page in an internal error).
_RUN_FIELDS = ("label", "steps", "status", "exit_code", "path")


def _run(run: dict[str, Any]) -> dict[str, str]:
    return {k: _s(run.get(k)) for k in _RUN_FIELDS}


def build(data: dict[str, Any], *, root: Path | None, cwd: Path | None = None) -> View:
    """The page's content from a JSON report; ``root``: where source files may be read."""
    div = _d(data.get("first_divergence"))
    view = View(verdict=_s(data.get("verdict")) or "error", headline=_headline(data, div),
                exit_code=_i(data.get("exit_code")), command=_s(data.get("command")),
                runs=[_run(_d(r)) for r in _l(data.get("runs"))],
                baseline=_s(data.get("baseline")))
    if div:
        _finding(view, div, root, cwd)
    view.fixes = sorted((_fix(s) for s in _l(data.get("suggestions"))),
                        key=lambda f: {True: 0, None: 1, False: 2}[f.verified])
    for entry in _l(data.get("sources")):
        src = _d(_d(entry).get("first_divergence"))
        where = ", ".join(x for x in (_step(src.get("step")), _s(src.get("op")),
                                      _s(src.get("source"))) if x)
        view.sources.append(Source(where, [_fix(s) for s in _l(_d(entry).get("suggestions"))]))
    combined = _d(data.get("combined_fix"))
    if combined:
        view.combined_fix = CombinedFix(
            env=[(_s(k), _s(v)) for k, v in _d(combined.get("env")).items()],
            code=[_s(c) for c in _l(combined.get("code"))],
            verification=_verification(combined), verified=_bool(combined.get("verified")))
    _growth(view, [_d(g) for g in _l(data.get("growth"))])
    _repeatability(view, _d(data.get("repeatability")))
    view.environment_differences = [(_s(d.get("key")), _s(d.get("a")), _s(d.get("b")))
                                    for d in map(_d, _l(data.get("environment_differences")))]
    environment = sorted((_s(k), _s(v)) for k, v in _d(data.get("environment")).items()
                         if k != "hostname")  # shared pages need no machine names
    view.environment = [(k, v) for k, v in environment if v != "(unset)"]
    view.unset = [k.removeprefix("env.") for k, v in environment if v == "(unset)"]
    view.notes = [_s(n) for n in [*_l(div.get("notes")), *_l(data.get("notes"))]]
    view.captures = [_s(c) for c in _l(data.get("captures"))]
    return view


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _step(value: Any) -> str:
    return "init" if value is None else f"step {_s(value)}"


def _headline(data: dict[str, Any], div: dict[str, Any]) -> str:
    if not div:
        runs = _l(data.get("runs"))
        if data.get("verdict") == "deterministic":
            if _l(data.get("contained")):  # a difference that never reached training
                return f"{len(runs)} runs trained bitwise identically"
            return f"{len(runs)} runs are bitwise identical"
        return "no verdict"
    what = {"op": f"{_s(div.get('op'))} creates the difference",
            "entry": f"{_s(div.get('op')) or 'a tensor'} enters with different values",
            "structure": "the runs execute different ops",
            "init": "the initial state already differs",
            "seed": f"{_s(div.get('op')) or 'a seeding call'} {got(_s(div.get('op')))} a "
                    "different seed",
            }.get(_s(div.get("kind")), "the runs differ")
    if div.get("localized") is False:
        what = "the runs diverge"
    return f"{_step(div.get('step'))}, {_s(div.get('phase'))}: {what}"


def _finding(view: View, div: dict[str, Any], root: Path | None, cwd: Path | None) -> None:
    view.op, view.source = _s(div.get("op")), _s(div.get("source"))
    view.source_text = _s(div.get("source_text"))
    view.snippet = [snippet.SnippetLine(x.number, printable(x.text), x.focus)
                    for x in snippet.read(view.source, view.source_text, root, cwd)]
    mismatched, numel = _i(div.get("mismatched_elements")), _i(div.get("numel"))
    differs = ""
    if mismatched is not None and numel:
        differs = f"{mismatched:,} of {numel:,} elements ({100.0 * mismatched / numel:.1f}%)"
        biggest = _f(div.get("max_abs_diff"))
        if biggest is not None:
            differs += f"; largest |a-b| {num(biggest)}"
    rows = [("kind", _s(div.get("kind"))), ("step", _step(div.get("step"))),
            ("phase", _s(div.get("phase"))), ("op", view.op), ("node", _s(div.get("node"))),
            ("record", _s(div.get("op_index"))), ("module", _s(div.get("module"))),
            ("source", view.source), ("rank", _s(div.get("rank"))), ("differs", differs),
            ("device", _s(div.get("device")))]
    view.finding = [(k, v) for k, v in rows if v]
    for c in map(_d, _l(div.get("context"))):
        view.context.append({"index": _s(c.get("index")), "op": _s(c.get("op")),
                             "module": _s(c.get("module")), "source": _s(c.get("source")),
                             "state": _s(c.get("state")), "focus": "focus" if c.get("focus")
                             is True else ""})


def _verification(entry: dict[str, Any]) -> str:
    verified, steps = _bool(entry.get("verified")), _i(entry.get("verified_steps"))
    cost = _f(entry.get("cost_ratio"))
    if verified is True:
        text = "verified" + (f": the runs repeat over {steps} steps" if steps else "")
        return text + (f"; cost {cost:.2f}x step time" if cost else "")
    note = _s(entry.get("verify_note"))
    if verified is False:
        return f"not verified: {note}" if note else "not verified"
    return note


def _fix(entry: Any) -> Fix:
    s = _d(entry)
    info = [_s(s.get("where")), f"applies to {_s(s.get('applies'))}" if s.get("applies") else "",
            f"cost: {_s(s.get('cost'))}" if s.get("cost") else "", _s(s.get("note")),
            *(_s(d) for d in _l(s.get("details")))]
    links = []
    for link in map(_s, _l(s.get("sources"))):
        safe = link.startswith(("https://", "http://")) and " " not in link
        links.append((link, link if safe else ""))
    return Fix(id=_s(s.get("id")), title=_s(s.get("title")), cause=_s(s.get("cause")),
               fix=_s(s.get("fix")), verified=_bool(s.get("verified")),
               verification=_verification(s), info=[x for x in info if x], links=links)


_PARTS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"))


def _growth(view: View, rows: list[dict[str, Any]]) -> None:
    rows = [g for g in rows if _i(g.get("step")) is not None]
    if not rows:
        return
    steps = [int(g["step"]) for g in rows]
    view.first_step = next((int(g["step"]) for g in rows if _l(g.get("differing"))), None)
    loss = charts.Series("loss |a-b|", "loss",
                         [charts.Point(int(g["step"]), _f(g.get("loss_abs_diff"))) for g in rows])
    size: list[charts.Series] = [loss]
    frac: list[charts.Series] = []
    for part, label in _PARTS:
        states = [(int(g["step"]), _d(_d(g.get("state")).get(part))) for g in rows]
        size.append(charts.Series(f"{label} max |a-b|", part, [
            _point(step, st.get("max_abs_diff"), st.get("max_abs_diff_min"))
            for step, st in states], bound="at least"))
        frac.append(charts.Series(f"{label}", part, [
            _point(step, st.get("frac_differ"), st.get("frac_differ_max"))
            for step, st in states], bound="at most"))
    size.append(charts.Series("parameter sum |Σa-Σb|", "params-sum", [
        charts.Point(int(g["step"]), _f(_d(_d(g.get("state")).get("params")).get("sum_abs_diff")))
        for g in rows]))
    view.growth_chart = charts.step_chart(
        size, steps, log=True, y_label="|a - b| (log)", marked=view.first_step,
        title="how the difference grows: largest |a-b| per step")
    first = view.first_step if view.first_step is not None else steps[0]
    if any(p.drawable and p.step >= first for s in frac for p in s.points):  # else all 0
        view.fraction_chart = charts.step_chart(
            frac, steps, log=False, y_label="fraction differing", marked=view.first_step,
            title="fraction of elements that differ per step")
    for g in rows:
        state = _d(g.get("state"))
        view.growth_rows.append([
            _s(g.get("step")), num(_f(g.get("loss_a"))), num(_f(g.get("loss_b"))),
            num(_f(g.get("loss_abs_diff"))),
            *(_state_cell(_d(state.get(part))) for part, _ in _PARTS),
            ", ".join(_s(x) for x in _l(g.get("differing"))) or "—"])


def _point(step: int, exact: Any, bound: Any) -> charts.Point:
    if _f(exact) is not None:
        return charts.Point(step, _f(exact))
    return charts.Point(step, _f(bound), exact=False)


def _state_cell(state: dict[str, Any]) -> str:
    exact, low = _f(state.get("max_abs_diff")), _f(state.get("max_abs_diff_min"))
    if exact is not None:
        return num(exact)
    if state.get("differs") is True:
        return f"≥ {num(low)}" if low else "> 0"
    return "—"  # not recorded


def _repeatability(view: View, data: dict[str, Any]) -> None:
    runs = [_d(r) for r in _l(data.get("runs"))]
    if not runs:
        return
    view.distinct = _i(data.get("distinct_outcomes"))
    view.repeat_rows = [{"label": _s(r.get("label")), "steps": _s(r.get("steps")),
                         "final_loss": num(_f(r.get("final_loss"))),
                         "digest": _s(r.get("weights_digest")), "outcome": _s(r.get("outcome")),
                         "status": _s(r.get("status"))} for r in runs]
    view.outcome_chart = charts.outcome_chart([
        charts.RunDot(_s(r.get("label")), _f(r.get("final_loss")), _s(r.get("outcome")),
                      _s(r.get("weights_digest"))) for r in runs])
