"""Faults, seventh round (FINDINGS.md): the user's interpreter settings and locale, names
from the program that are not UTF-8, and more."""

from __future__ import annotations

from pathlib import Path

from nondet.store import CaptureWriter, open_capture
from tests.conftest import run_cli, step_rows, write_capture

_ASCII_LOCALE = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def test_the_verdict_is_printed_under_an_ascii_locale(tmp_path: Path) -> None:
    # Trial: `LC_ALL=C PYTHONUTF8=0 nondet run base.py`: both runs finished, then
    # "internal error: UnicodeEncodeError: 'ascii' codec can't encode character '\u2014'"
    # (the verdict's em dash), exit 3. `diff` prints the same verdict line.
    rows = step_rows({"step": 0, "params_fp": 7}, {"step": 1, "params_fp": 8})
    a = write_capture(tmp_path / "run-a.h5", rows)
    b = write_capture(tmp_path / "run-b.h5", rows)
    result = run_cli("diff", str(a), str(b), cwd=tmp_path, env=_ASCII_LOCALE, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "deterministic" in result.stdout
    assert "internal error" not in result.stderr


def test_a_source_file_name_that_is_not_utf8_is_stored(tmp_path: Path) -> None:
    # Trial: a script importing its helper from a directory named in Latin-1 (b"lib\xe9"):
    # the op records' source "lib\udce9/helper.py:3" (Python's surrogate escape) failed the
    # capture's UTF-8 string table: "internal error: malformed b'S' frame", exit 3.
    writer = CaptureWriter(tmp_path / "run-a.h5", {"label": "a", "seed": 0})
    writer.add_env({"torch_version": "2.13.0"})
    name = b"lib\xe9".decode("utf-8", "surrogateescape")  # what os.fsdecode makes of it
    writer.add_strings(["aten.mm.default", f"{name}/helper.py:3"])
    writer.add_step(step_rows({"step": 0}))
    writer.close("complete", 0)
    capture = open_capture(tmp_path / "run-a.h5")
    assert "lib\\xe9/helper.py:3" in capture.strings


def test_a_non_ascii_script_under_an_ascii_locale_names_the_locale(tmp_path: Path) -> None:
    # Trial: `LC_ALL=C PYTHONUTF8=0 nondet run dé/trå.py`: refused with "the script has a
    # byte that is not UTF-8", which is false (its bytes are UTF-8; this Python decodes
    # them as ASCII), and the user is told to rename a file that is fine.
    (tmp_path / "dé").mkdir()
    (tmp_path / "dé" / "trå.py").write_text("print('hi')\n")
    result = run_cli("run", "--no-verify", "dé/trå.py", cwd=tmp_path, env=_ASCII_LOCALE,
                     timeout=120)
    assert result.returncode == 2, result.stderr
    assert "not UTF-8 (" not in result.stderr
    assert "PYTHONUTF8=1" in result.stderr and "Traceback" not in result.stderr
