"""The HTML report: escaping of everything a capture holds, source lines read only where
they may be, the growth chart's points, the `report` command and its bad input."""

from __future__ import annotations

import json
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from nondet import analysis
from nondet.records import Phase
from nondet.report import html, snippet
from nondet.store import open_capture
from tests.conftest import OpStream, run_cli, step_rows, write_capture

HOSTILE = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'
#: What the page may contain: no script, no image, no frame, no form, no external style.
ALLOWED_TAGS = {"html", "head", "meta", "title", "style", "body", "div", "p", "h1", "h2",
                "h3", "table", "tr", "th", "td", "pre", "span", "i", "code", "strong", "ul",
                "li", "a", "footer", "svg", "rect", "line", "text", "g", "circle", "polyline",
                "details", "summary"}


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.handlers: list[str] = []
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.handlers += [k for k, _ in attrs if k.startswith("on")]
        self.hrefs += [v or "" for k, v in attrs if k in ("href", "src")]


def _pair(tmp_path: Path, *, op: str = "aten.index_put.default", module: str = "table",
          source: str = "train.py:3", env_value: str = "2") -> tuple[Path, Path]:
    (tmp_path / "train.py").write_text("import torch\nmodel = torch.nn.Linear(4, 4)\n"
                                       "out = table[idx]  # line 3\nloss = out.sum()\n")

    def ops(differs: bool) -> OpStream:
        return (OpStream().add(0, "aten.mm.default", 11, 1, module="head", source="train.py:2")
                .add(0, op, 99 if differs else 14, 11, module=module, source=source,
                     phase=Phase.BACKWARD))

    steps: list[dict[str, Any]] = [
        {"step": -1, "params_fp": 1}, {"step": 0, "loss": 0.5, "params_fp": 3, "params_sum": 1.0},
        {"step": 1, "loss": 0.25, "params_fp": 5, "params_sum": 2.0},
        {"step": 2, "loss": 0.125, "params_fp": 7, "params_sum": 3.0}]
    a_steps, b_steps = step_rows(*steps), step_rows(*steps)
    for i, (fp, total, loss) in enumerate(((3, 1.0, 0.5), (50, 2.0001, 0.2500001),
                                           (70, 3.01, 0.126)), start=1):
        b_steps[i]["params_fp"], b_steps[i]["params_sum"], b_steps[i]["loss"] = fp, total, loss
    a = write_capture(tmp_path / "a.h5", a_steps, ops(False))
    b = write_capture(tmp_path / "b.h5", b_steps, ops(True),
                      env={"env.OMP_NUM_THREADS": env_value})
    return a, b


def _page(tmp_path: Path, **kwargs: str) -> tuple[str, dict[str, Any]]:
    a, b = _pair(tmp_path, **kwargs)
    data = analysis.compare_captures(open_capture(a), open_capture(b), suggest=True).to_json()
    return html.render(data, root=tmp_path, cwd=tmp_path), data


def test_strings_from_a_crafted_capture_are_text_never_markup(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    page, data = _page(tmp_path / "x", op=f"aten.{HOSTILE}", module=HOSTILE,
                       source=f"{HOSTILE}.py:3", env_value=HOSTILE)
    assert data["first_divergence"]["op"] == f"aten.{HOSTILE}"  # the capture did carry it
    parsed = _Tags()
    parsed.feed(page)
    assert parsed.tags <= ALLOWED_TAGS, parsed.tags - ALLOWED_TAGS
    assert parsed.handlers == [] and parsed.hrefs == [
        h for h in parsed.hrefs if h.startswith("https://")]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown, as text
    assert "default-src 'none'" in page  # and a policy that would block a script anyway


def test_the_growth_chart_has_one_point_per_step_and_marks_the_first(tmp_path: Path) -> None:
    page, data = _page(tmp_path)
    steps = [g["step"] for g in data["growth"]]
    assert steps == [0, 1, 2]
    chart = page[page.index('id="growth-chart"'):page.index('id="growth"')]
    loss = chart[chart.index('data-series="loss"'):]
    loss = loss[:loss.index("</g>")]
    assert [int(x.split('"')[0]) for x in loss.split('class="point" data-step="')[1:]] == steps
    assert 'class="marker" data-step="1"' in chart  # step 0 is identical, step 1 is not


def test_source_lines_around_the_finding_are_shown(tmp_path: Path) -> None:
    page, _ = _page(tmp_path)
    assert '<span class="focus"><i>3</i>out = table[idx]  # line 3</span>' in page
    assert "<i>1</i>import torch" in page


def test_snippet_reads_only_python_files_inside_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "project", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    line = "token = 'abc'"
    for folder in (root, outside):
        (folder / "t.py").write_text(f"a = 1\n{line}\nb = 2\n")
    (outside / "t.txt").write_text(f"{line}\n")
    (root / "t.txt").write_text(f"a\n{line}\n")
    os.symlink(outside / "t.py", root / "link.py")
    assert [x.text for x in snippet.read("t.py:2", line, root, root)] == ["a = 1", line, "b = 2"]
    for source in ("../secret/t.py:2", f"{outside}/t.py:2", "link.py:2", "t.txt:2",
                   "../secret/t.txt:1"):
        assert snippet.read(source, line, root, root) == [], source
    assert snippet.read("t.py:2", "another line", root, root) == []  # not what ran
    assert snippet.read("t.py:2", line, None, root) == []  # no root: nothing read
    assert snippet.read("t.py:99", line, root, root) == []


def test_report_command_from_json_and_from_captures(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    assert run_cli("diff", str(a), str(b), "--json", "r.json", cwd=tmp_path).returncode == 1
    result = run_cli("report", "r.json", "--html", "from-json.html", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "aten.index_put.default" in (tmp_path / "from-json.html").read_text()
    run = tmp_path / "captures"
    run.mkdir()
    shutil.copy(a, run / "run-a.h5")
    shutil.copy(b, run / "run-b.h5")
    result = run_cli("report", "captures", "--html", "from-captures.html", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "out = table[idx]" in (tmp_path / "from-captures.html").read_text()


@pytest.mark.parametrize("content, says", [
    ("{not json", "cannot read"), ("[1, 2]", "not a nondet JSON report"),
    ('{"nondet_report_version": 99}', "not a nondet JSON report"), (None, "does not exist"),
    ("", "cannot read")])
def test_report_command_bad_input_is_one_line_and_exit_2(tmp_path: Path, content: str | None,
                                                          says: str) -> None:
    if content is not None:
        (tmp_path / "r.json").write_text(content)
    result = run_cli("report", "r.json", "--html", "out.html", cwd=tmp_path)
    assert result.returncode == 2
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out.html").exists()


def test_a_json_report_with_wrong_types_still_renders(tmp_path: Path) -> None:
    data = {"nondet_report_version": 1, "verdict": "<b>", "exit_code": "1",
            "first_divergence": {"op": ["x"], "step": {"a": 1}, "context": [1, "x", None],
                                 "source": 5, "notes": "n"},
            "suggestions": [1, "a", {"verified": "yes", "sources": ["javascript:alert(1)"]}],
            "growth": [{"step": "0"}, {"step": 0, "state": [], "loss_abs_diff": "1"}],
            "repeatability": {"runs": [{"label": 3, "final_loss": "x"}]},
            "environment": ["x"], "runs": "all"}
    (tmp_path / "r.json").write_text(json.dumps(data))
    result = run_cli("report", "r.json", "--html", "out.html", cwd=tmp_path)
    assert result.returncode == 2, result.stderr  # an exit code that is not 0 or 1
    page = (tmp_path / "out.html").read_text()
    assert 'href="javascript' not in page and "&lt;b&gt;" in page


def test_html_without_the_extra_names_it_and_exits_2(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    shim = tmp_path / "shim" / "jinja2"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('no jinja2 here')\n")
    path = os.pathsep.join(x for x in (str(shim.parent), os.environ.get("PYTHONPATH")) if x)
    result = run_cli("diff", str(a), str(b), "--html", "out.html", cwd=tmp_path,
                     env={"PYTHONPATH": path})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "nondet: error: --html needs the optional extra `html` (Jinja2): "
        "pip install 'nondet[html]'"]
    assert not (tmp_path / "out.html").exists()


@pytest.mark.e2e
def test_check_writes_the_page_and_refuses_a_directory_first(tmp_path: Path) -> None:
    steps = str(Path(__file__).parent / "data" / "scripts" / "steps.py")
    (tmp_path / "taken").mkdir()
    refused = run_cli("check", "--html", "taken", "--out", "out", steps, cwd=tmp_path)
    assert refused.returncode == 2 and "is a directory" in refused.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran
    result = run_cli("check", "--html", "page.html", "--out", "out", steps, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "page.html").read_text()
    assert "nondet: deterministic" in page and 'id="environment"' in page


def test_repeatability_chart_has_one_dot_per_run_on_its_outcome_row(tmp_path: Path) -> None:
    runs = [{"label": f"r{i}", "steps": 4, "final_loss": loss, "weights_digest": digest,
             "outcome": outcome, "status": "complete"}
            for i, (loss, digest, outcome) in enumerate(
                [(1.5, "aa", "A"), (1.25, "bb", "B"), (1.5, "aa", "A")], start=1)]
    page = html.render({"nondet_report_version": 1, "verdict": "nondeterministic",
                        "repeatability": {"runs": runs, "distinct_outcomes": 2}}, root=None)
    chart = page[page.index('id="outcome-chart"'):page.index('id="repeatability"')]
    assert chart.count('class="run"') == 3
    assert "A: aa (2)" in chart and "B: bb (1)" in chart
    assert "3 runs, 2 distinct outcomes" in page


def test_fixes_verified_first_with_every_source_and_the_combined_fix(tmp_path: Path) -> None:
    def fix(fix_id: str, verified: bool | None) -> dict[str, Any]:
        return {"id": fix_id, "title": fix_id, "cause": "c", "fix": f"do {fix_id}",
                "verified": verified, "verified_steps": 6 if verified else None,
                "cost_ratio": 1.07 if verified else None, "verify_note": ""}

    data = {"nondet_report_version": 1, "verdict": "nondeterministic", "exit_code": 1,
            "suggestions": [fix("NOT-HELPED", False), fix("CODE-ONLY", None),
                            fix("WORKS", True)],
            "sources": [{"first_divergence": {"step": 0, "op": "aten.mm.default",
                                              "source": "t.py:3"},
                         "suggestions": [fix("FIRST-SOURCE", True)]},
                        {"first_divergence": {"step": 2, "op": "dataloader:batch#0",
                                              "source": "t.py:9"},
                         "suggestions": [fix("SECOND-SOURCE", None)]}],
            "combined_fix": {"env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
                             "code": ["torch.use_deterministic_algorithms(True)"],
                             "verified": True, "verified_steps": 20, "cost_ratio": 1.12}}
    page = html.render(data, root=None)
    order = [page.index(f"[{x}]") for x in ("WORKS", "CODE-ONLY", "NOT-HELPED")]
    assert order == sorted(order)
    assert "the runs repeat over 6 steps; cost 1.07x step time" in page
    assert page.index("step 0, aten.mm.default, t.py:3") < page.index("[FIRST-SOURCE]")
    assert page.index("step 2, dataloader:batch#0, t.py:9") < page.index("[SECOND-SOURCE]")
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in page
    assert "the runs repeat over 20 steps; cost 1.12x step time" in page


@pytest.mark.parametrize("kind", ["capture", "fifo"])
def test_report_command_names_a_capture_or_special_file_given_for_a_report(
        tmp_path: Path, kind: str) -> None:
    """A capture file (the user meant its directory) or a FIFO is named for what it is,
    not called "not JSON" or "does not exist"; the FIFO is never opened (it would block)."""
    given = tmp_path / "run-a.h5"
    if kind == "capture":
        shutil.copy(_pair(tmp_path)[0], given)
    else:
        os.mkfifo(given)
    result = run_cli("report", str(given), "--html", "out.html", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    says = {"capture": "is a capture, not a JSON report: give the directory",
            "fifo": "is not a regular file"}[kind]
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_numbers_too_large_for_a_float_in_a_crafted_report(tmp_path: Path) -> None:
    """A crafted report's ``10**400`` (JSON has no limit) in every numeric field: the page
    is made; ``mismatched_elements`` and ``cost_ratio`` raised OverflowError, exit 3."""
    _, data = _page(tmp_path)

    def huge(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: huge(v) for k, v in value.items()}
        if isinstance(value, list):
            return [huge(v) for v in value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return 10**400
        return value

    crafted = huge(data)
    crafted["first_divergence"]["numel"] = 10  # so that the share of elements is computed
    crafted["nondet_report_version"], crafted["exit_code"] = 1, 1
    (tmp_path / "r.json").write_text(json.dumps(crafted))
    result = run_cli("report", "r.json", "--html", "out.html", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and (tmp_path / "out.html").exists()


@pytest.mark.parametrize("run", ["str", None, {}, [1, "x", None], {"label": ["x"]}])
def test_a_run_of_the_wrong_shape_in_a_crafted_report(tmp_path: Path, run: Any) -> None:
    """Faults round 9: ``runs[0]`` given as a string, null, a list or ``{}`` ended the page
    in an internal error ('dict object' has no attribute 'label', exit 3)."""
    _, data = _page(tmp_path)
    data["runs"][0] = run
    (tmp_path / "r.json").write_text(json.dumps(data))
    result = run_cli("report", "r.json", "--html", "out.html", cwd=tmp_path)
    assert result.returncode == data["exit_code"], result.stdout + result.stderr
    assert "Traceback" not in result.stderr and (tmp_path / "out.html").exists()
