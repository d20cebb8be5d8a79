"""bench.py --write: a run of one framework or model replaces only its own tables."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from measure import MARKERS, merge_tables, replace_section, section


def _table(title: str, figure: str) -> str:
    return (f"### {title}\n\n| measure | result |\n| --- | --- |\n| a | {figure} |\n\n"
            f"Measured {figure}.\n")


def test_a_partial_run_keeps_the_other_tables(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    tables = [_table("torch, reference model", "1.0x"), _table("torch, narrow model", "2.0x"),
              _table("tensorflow, narrow model", "3.0x")]
    doc.write_text("# Benchmarks\n\nintro\n\n" + MARKERS[0] + "\n" + "\n".join(tables)
                   + MARKERS[1] + "\n\nafter\n")
    new = _table("torch, narrow model", "1.5x")
    replace_section(doc, merge_tables(section(doc, *MARKERS), new), *MARKERS)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n") and text.endswith("\n\nafter\n")
    kept = section(doc, *MARKERS)
    assert kept == "\n" + "\n".join([tables[0], new, tables[2]])
    assert "2.0x" not in kept


def test_a_new_table_is_appended_and_a_missing_section_is_empty(tmp_path: Path) -> None:
    assert section(tmp_path / "none.md", *MARKERS) == ""
    old = _table("torch, narrow model", "2.0x")
    added = _table("comm, reference model", "1.1x")
    assert merge_tables(old, added) == old + "\n" + added
