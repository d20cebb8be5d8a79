"""JUnit XML for CI systems (GitHub, GitLab and Jenkins read it): one test case per check."""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime
from pathlib import Path
from xml.etree import ElementTree as ET

from rich.console import Console

from nondet.report import Report, text

# Terminal escape sequences (CSI, OSC, two-character): dropped whole from XML, where they
# mean nothing; any other control character becomes U+FFFD (XML 1.0 forbids most of them).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")


def xml_text(value: str) -> str:
    """Any text (a script's error output, strings from a capture) as valid XML 1.0 content."""
    return text.printable(_ANSI.sub("", value), newlines=True)


def write(report: Report, path: Path, name: str, seconds: float, error: str = "") -> None:
    """``error``: the one-line message of a check that could not run (exit code 2)."""
    name, error = xml_text(name), xml_text(error)
    failed = report.verdict == "nondeterministic"
    errored = bool(error)
    attrs = {"tests": "1", "failures": str(int(failed)), "errors": str(int(errored)),
             "skipped": "0", "time": f"{seconds:.3f}"}
    suites = ET.Element("testsuites", {"name": "nondet", **attrs})
    suite = ET.SubElement(suites, "testsuite", {
        "name": "nondet check", **attrs,
        "timestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S"),
    })
    case = ET.SubElement(suite, "testcase", {"classname": "nondet.determinism", "name": name,
                                             "time": f"{seconds:.3f}"})
    if errored:
        node = ET.SubElement(case, "error", {"message": error, "type": "nondet.error"})
        node.text = error
    elif failed:
        node = ET.SubElement(case, "failure", {"message": xml_text(summary_line(report)),
                                               "type": "nondet.nondeterminism"})
        node.text = xml_text(plain_text(report))
    out = ET.SubElement(case, "system-out")
    out.text = xml_text(plain_text(report)) if not errored else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def plain_text(report: Report) -> str:
    buffer = io.StringIO()
    text.render(report, Console(file=buffer, width=100, color_system=None, highlight=False,
                                soft_wrap=True))
    return buffer.getvalue()


def summary_line(report: Report) -> str:
    """One line: the verdict, where, and the fix."""
    div = report.first_divergence
    if div is None:
        steps = max((r.steps for r in report.runs), default=0)
        if report.baseline:
            return f"deterministic: bitwise identical to the baseline over {steps} steps"
        return f"deterministic: {len(report.runs)} runs bitwise identical over {steps} steps"
    where = "init" if div.step is None else f"step {div.step}"
    what = div.op or ", ".join(div.step_fields) or div.kind
    line = f"nondeterministic at {where} ({div.phase}): {what}"
    if div.source:
        line += f" at {div.source}"
    if div.module:
        line += f" in {div.module}"
    if report.suggestions:
        first = report.suggestions[0]
        line += f"; fix: {first.fix} [{first.recipe.id}]"
        if first.verified:  # re-run with it applied: the runs repeated
            cost = f", cost {first.cost_ratio:.2f}x step time" if first.cost_ratio else ""
            line += f" (verified over {first.verified_steps} steps{cost})"
    combined = report.combined_fix
    if combined is not None and len(report.sources) > 1:
        fixes = "; ".join([f"{k}={v}" for k, v in combined.env.items()] + combined.code)
        line += f"; {len(report.sources)} sources, all fixes: {fixes}"
        if combined.verified:
            cost = f", step time {combined.cost_ratio:.2f}x" if combined.cost_ratio else ""
            line += f" (verified together over {combined.verified_steps} steps{cost})"
    return line
