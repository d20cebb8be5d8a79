"""SVG charts for the HTML report, written by hand: a few lines, circles and labels need no
plotting library, and the markup stays small, self-contained and free of scripts.

Every string that reaches the markup goes through ``_esc`` (labels come from captures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

#: Okabe-Ito colours: told apart with the common colour-vision deficiencies.
PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#000000", "#e69f00", "#56b4e9")

_W, _H = 760, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 170, 20, 46
_ZERO_BAND = 18  # pixels below the log axis where exact zeros are drawn


@dataclass
class Point:
    step: int
    value: float | None  # None: not known at this step (nothing drawn)
    exact: bool = True  # False: a bound (drawn hollow), see the series' note

    @property
    def drawable(self) -> bool:
        return self.value is not None and math.isfinite(self.value) and self.value >= 0


@dataclass
class Series:
    name: str
    key: str  # CSS class and data attribute (a fixed word, never from a capture)
    points: list[Point] = field(default_factory=list)
    bound: str = ""  # what a hollow point means: "at least", "at most"


def _esc(text: object) -> str:
    return escape(str(text), quote=True)


def _num(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.3g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"


def step_chart(series: list[Series], steps: list[int], *, log: bool, y_label: str,
               marked: int | None, title: str) -> str:
    """One column per step compared, one line per series; on a log scale exact zeros sit on
    a band below the axis (log 0 does not exist), on a linear one from 0 to 1."""
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM - (_ZERO_BAND if log else 0)
    values = [p.value for s in series for p in s.points if p.drawable and p.value]
    if log:
        low = math.floor(math.log10(min(values))) if values else -16
        high = math.ceil(math.log10(max(values))) if values else 0
        high = max(high, low + 1)
    else:
        low, high = 0, 1

    def x_of(i: int) -> float:
        return _LEFT + (plot_w * (i + 0.5) / len(steps) if steps else 0)

    def y_of(value: float) -> float:
        if log:
            if value == 0:
                return _TOP + plot_h + _ZERO_BAND
            return _TOP + plot_h * (high - math.log10(value)) / (high - low)
        return _TOP + plot_h * (high - value) / (high - low)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
           f'viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}"><title>{_esc(title)}</title>',
           f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" class="plot"/>']
    ticks = range(low, high + 1) if log else (0, 0.25, 0.5, 0.75, 1)
    for t in ticks:
        y = y_of(10.0**t if log else float(t))
        label = f"1e{t}" if log else f"{t:g}"
        out.append(f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'class="grid"/><text x="{_LEFT - 6}" y="{y + 4:.1f}" class="tick" '
                   f'text-anchor="end">{label}</text>')
    if log:
        y = y_of(0.0)
        out.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">0'
                   f'</text><line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y:.1f}" '
                   f'y2="{y:.1f}" class="grid zero"/>')
    every = max(1, math.ceil(len(steps) / 25))
    for i, step in enumerate(steps):
        if i % every == 0 or step == marked:
            out.append(f'<text x="{x_of(i):.1f}" y="{_H - _BOTTOM + 16}" class="tick" '
                       f'text-anchor="middle">{step}</text>')
    if marked is not None and marked in steps:
        x = x_of(steps.index(marked))
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{_H - _BOTTOM}" '
                   f'class="marker" data-step="{marked}"/><text x="{x + 4:.1f}" '
                   f'y="{_TOP + 12}" class="marker-label">first difference (step {marked})'
                   '</text>')
    out.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{_H - 8}" class="axis" '
               'text-anchor="middle">step</text>'
               f'<text x="14" y="{_TOP + plot_h / 2:.0f}" class="axis" text-anchor="middle" '
               f'transform="rotate(-90 14 {_TOP + plot_h / 2:.0f})">{_esc(y_label)}</text>')
    index = {step: i for i, step in enumerate(steps)}
    for n, s in enumerate(series):
        colour = PALETTE[n % len(PALETTE)]
        drawn = [p for p in s.points if p.drawable and p.step in index]
        path = " ".join(f"{x_of(index[p.step]):.1f},{y_of(p.value or 0.0):.1f}" for p in drawn)
        out.append(f'<g class="series {s.key}" data-series="{s.key}">')
        if len(drawn) > 1:
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                       'stroke-width="1.5"/>')
        for p in drawn:
            value = p.value or 0.0
            fill = colour if p.exact else "#ffffff"
            what = "" if p.exact else f"{s.bound} "
            out.append(f'<circle cx="{x_of(index[p.step]):.1f}" cy="{y_of(value):.1f}" r="3.5" '
                       f'fill="{fill}" stroke="{colour}" stroke-width="1.5" class="point" '
                       f'data-step="{p.step}"><title>step {p.step}: {_esc(s.name)} '
                       f'{what}{_num(value)}</title></circle>')
        out.append("</g>")
        y = _TOP + 8 + 18 * n
        legend_x = _W - _RIGHT + 14
        out.append(f'<circle cx="{legend_x}" cy="{y}" r="4" fill="{colour}"/>'
                   f'<text x="{legend_x + 10}" y="{y + 4}" class="legend">{_esc(s.name)}</text>')
    if any(not p.exact for s in series for p in s.points if p.drawable):
        y = _TOP + 8 + 18 * len(series)
        bounds = ", ".join(sorted({s.bound for s in series if s.bound}))
        out.append(f'<circle cx="{_W - _RIGHT + 14}" cy="{y}" r="4" fill="#ffffff" '
                   f'stroke="#555"/><text x="{_W - _RIGHT + 24}" y="{y + 4}" class="legend">'
                   f'hollow: a bound ({_esc(bounds)})</text>')
    out.append("</svg>")
    return "".join(out)


@dataclass
class RunDot:
    label: str
    final_loss: float | None
    outcome: str
    digest: str


def outcome_chart(runs: list[RunDot]) -> str:
    """Final loss of each of the N runs, one row per outcome (runs that ended with identical
    weights share a row): how many distinct results, and how far apart their losses are."""
    outcomes = list(dict.fromkeys(r.outcome for r in runs))
    losses = [r.final_loss for r in runs if r.final_loss is not None
              and math.isfinite(r.final_loss)]
    low, high = (min(losses), max(losses)) if losses else (0.0, 1.0)
    if high == low:  # identical losses: one spot in the middle of a narrow axis
        span = max(abs(low) * 1e-6, 1e-12)
        low, high = low - span, high + span
    row_h, left, right = 30, 170, 40
    height = _TOP + row_h * len(outcomes) + 50
    plot_w = _W - left - right

    def x_of(value: float) -> float:
        return left + plot_w * (value - low) / (high - low)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
           f'viewBox="0 0 {_W} {height}" width="{_W}" height="{height}">'
           '<title>final loss of each run, by outcome</title>']
    for n, outcome in enumerate(outcomes):
        y = _TOP + row_h * n + row_h / 2
        digest = next(r.digest for r in runs if r.outcome == outcome)
        count = sum(1 for r in runs if r.outcome == outcome)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'class="grid"/><text x="{left - 8}" y="{y + 4:.1f}" class="legend" '
                   f'text-anchor="end">{_esc(outcome)}: {_esc(digest)} ({count})</text>')
        colour = PALETTE[n % len(PALETTE)]
        for r in runs:
            if r.outcome != outcome or r.final_loss is None or not math.isfinite(r.final_loss):
                continue
            out.append(f'<circle cx="{x_of(r.final_loss):.1f}" cy="{y:.1f}" r="6" '
                       f'fill="{colour}" fill-opacity="0.6" class="run" data-run="{_esc(r.label)}">'
                       f'<title>{_esc(r.label)}: final loss {r.final_loss!r}</title></circle>')
    axis_y = _TOP + row_h * len(outcomes) + 16
    for value in (low, (low + high) / 2, high):
        out.append(f'<text x="{x_of(value):.1f}" y="{axis_y}" class="tick" '
                   f'text-anchor="middle">{value:.9g}</text>')
    out.append(f'<text x="{left + plot_w / 2:.0f}" y="{axis_y + 22}" class="axis" '
               'text-anchor="middle">final loss</text></svg>')
    return "".join(out)
