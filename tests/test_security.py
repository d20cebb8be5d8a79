"""Captures are untrusted input: a crafted capture or baseline must not disclose local files,
interpret markup, reach the terminal with escape sequences, or break the JUnit XML."""

from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from nondet import analysis, finding
from nondet.records import Phase
from nondet.report import Divergence, Report, github, junit
from nondet.session import SourceLocator
from nondet.store import SOURCE_TEXT_MARK, open_capture
from tests.conftest import OpStream, run_cli, step_rows, write_capture

SECRET = "NONDET_TEST_SECRET=hunter2"
HOSTILE = "\x1b[2J\x1b]0;owned\x07[bold red]boom[/][/]\x9b31m\u202e"


def _pair(tmp_path: Path, source: str, name: str = "aten.index_put.default",
          module: str = "table") -> tuple[Path, Path]:
    def ops(out: int) -> OpStream:
        return (OpStream().add(0, "aten.mm.default", 11, 1, module="head", source="train.py:1")
                .add(0, name, out, 11, module=module, source=source, phase=Phase.BACKWARD))

    steps = step_rows({"step": -1}, {"step": 0, "grads_fp": 2})
    other = steps.copy()
    other[1]["grads_fp"] = 3
    return (write_capture(tmp_path / "a.h5", steps, ops(12)),
            write_capture(tmp_path / "b.h5", other, ops(13)))


def test_a_source_path_in_a_capture_is_never_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.env"
    secret.write_text(SECRET + "\n")
    for source in (f"{secret}:1", "../" * 12 + f"{str(secret).lstrip('/')}:1",
                   "/proc/self/environ:1"):
        a, b = _pair(tmp_path, source)
        result = run_cli("diff", "--json", str(tmp_path / "r.json"), str(a), str(b),
                         cwd=tmp_path, env={"NONDET_TEST_SECRET": "hunter2"})
        assert result.returncode == 1, result.stderr
        assert source in result.stdout  # the location is shown, its file's content is not
        assert "hunter2" not in result.stdout + result.stderr
        assert "hunter2" not in (tmp_path / "r.json").read_text()


def test_source_text_is_what_the_run_captured(tmp_path: Path) -> None:
    train = tmp_path / "train.py"
    train.write_text("import torch\nout = table[idx]  # captured\n")
    a, b = _pair(tmp_path, "train.py:2")
    train.write_text("import torch\nprint('changed after the run')\n")  # never read back
    ca, cb = open_capture(a), open_capture(b)
    div = analysis.compare_captures(ca, cb).first_divergence
    assert div is not None and div.source == "train.py:2"
    assert div.source_text == "out = table[idx]  # captured"
    (tmp_path / "other.py").write_text("secret = 1\n")
    assert finding.source_text(ca, "other.py:1") == ""  # no text captured for it
    assert ca.source_text("train.py:2") == "out = table[idx]  # captured"


class _Session:
    def __init__(self) -> None:
        self.strings: list[str] = []

    def intern(self, text: str) -> int:
        if text not in self.strings:
            self.strings.append(text)
        return self.strings.index(text)


def test_the_child_interns_the_source_line_with_its_location(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("x = 1\n    y = compute(x)   \n" + "z = '" + "a" * 500 + "'\n")
    session = _Session()
    locator = SourceLocator(session)  # type: ignore[arg-type]
    sid = locator.intern_location(str(script), 2)
    assert locator.intern_location(str(script), 2) == sid  # once per location
    shown = session.strings[sid]
    assert f"{SOURCE_TEXT_MARK}{shown}\ny = compute(x)" in session.strings
    locator.intern_location(str(script), 3)
    long_text = session.strings[-1].partition("\n")[2]
    assert long_text.startswith("z = 'aaa") and len(long_text) <= 200
    assert len(session.strings) == 4


def test_capture_strings_are_not_markup_and_escape_sequences_never_print(
        tmp_path: Path) -> None:
    a, b = _pair(tmp_path, f"train.py:{HOSTILE}", name=f"aten.{HOSTILE}", module=HOSTILE)
    for args in (("show", "--ops", "0", str(b)), ("diff", str(a), str(b))):
        result = run_cli(*args, cwd=tmp_path)
        assert result.returncode in (0, 1), result.stderr
        out = result.stdout + result.stderr
        assert "[bold red]boom[/][/]" in result.stdout  # shown as the text it is
        for char in ("\x1b", "\x9b", "\x07", "\u202e"):
            assert char not in out, (args, char)


def test_junit_stays_well_formed_whatever_the_script_printed(tmp_path: Path) -> None:
    failed = Report(verdict="error", exit_code=2, runs=[], notes=[])  # type: ignore[arg-type]
    error = "the script failed: \x1b[31mRuntimeError\x1b[0m \x00\x08 bad \ud800 end"
    path = tmp_path / "j.xml"
    junit.write(failed, path, "train.py \x1b[1m", 1.0, error=error)
    node = ET.parse(path).getroot().find(".//error")
    assert node is not None and "RuntimeError" in node.attrib["message"]
    assert "\x1b" not in path.read_text(encoding="utf-8")

    report = Report(verdict="nondeterministic", exit_code=1, runs=[],  # type: ignore[arg-type]
                    first_divergence=Divergence(kind="op", step=0, phase="forward",
                                                op=f"aten.{HOSTILE}", module=HOSTILE,
                                                source="train.py:3", source_text=HOSTILE))
    junit.write(report, path, "train.py", 1.0)
    failure = ET.parse(path).getroot().find(".//failure")
    assert failure is not None and "boom" in (failure.text or "")


@pytest.mark.parametrize("source, annotated", [
    ("train.py:3", "file=train.py,line=3,"),
    ("src/model/net.py:12", "file=src/model/net.py,line=12,"),
    ("/proc/self/environ:1", None),
    ("../../etc/passwd:1", None),
    ("src/../../outside.py:4", None),
    ("~/x.py:1", None),
    ("C:\\x.py:1", None),
    ("train.py\n::set-output name=x::y:1", None),
    ("train.py:1,file=/etc/passwd", None),
])
def test_annotations_name_only_paths_inside_the_checkout(source: str,
                                                         annotated: str | None) -> None:
    report = Report(verdict="nondeterministic", exit_code=1, runs=[],  # type: ignore[arg-type]
                    first_divergence=Divergence(kind="op", step=0, phase="forward",
                                                op="aten.mm.default", source=source))
    (line,) = [x for x in github.workflow_commands(report) if x.startswith("::error")]
    assert "\n" not in line
    if annotated is None:
        assert line.startswith("::error title=")
    else:
        assert line.startswith(f"::error {annotated}title=")



def test_an_absolute_path_in_the_workspace_is_annotated_relative(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GITHUB_WORKSPACE", "/home/runner/work/repo")
    report = Report(verdict="nondeterministic", exit_code=1, runs=[],  # type: ignore[arg-type]
                    first_divergence=Divergence(kind="op", step=0, phase="forward",
                                                source="/home/runner/work/repo/src/t.py:9"))
    (line,) = github.workflow_commands(report)
    assert line.startswith("::error file=src/t.py,line=9,")
    report.first_divergence.source = "/home/runner/work/repo/../other/t.py:9"  # type: ignore
    assert github.workflow_commands(report)[0].startswith("::error title=")


def test_a_file_name_cannot_drive_the_terminal_through_an_error(tmp_path: Path) -> None:
    path = tmp_path / "evil\x1b[2J\x1b]0;owned\x07.h5"
    path.write_text("not a capture")
    result = run_cli("show", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert "not an HDF5 file" in result.stderr
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
