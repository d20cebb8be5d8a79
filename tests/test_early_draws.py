"""``early_draws.EarlyDraws``: which draws before the script's seeding call it names."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from nondet import early_draws

THIS_FILE = __file__


class _Log:
    disabled = False

    def seeded(self, apis: frozenset[str]) -> bool:
        return False

    def is_users(self, frame: FrameType) -> bool:
        return frame.f_code.co_filename == THIS_FILE  # this file is "the script"

    def failed(self) -> None:
        raise AssertionError("EarlyDraws failed")


class _Sources:
    def intern_location(self, filename: str, line: int) -> int:
        return line


class _Session:
    sources = _Sources()

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}

    def string(self, sid: int) -> str:
        return f"script.py:{sid}"

    def send_facts(self, facts: dict[str, Any]) -> None:
        self.facts.update(facts)


def _watch(monkeypatch: Any) -> tuple[_Session, early_draws.EarlyDraws]:
    session = _Session()
    monkeypatch.setattr(early_draws.session_module, "current", lambda: session)
    return session, early_draws.EarlyDraws(session, _Log())  # type: ignore[arg-type]


def test_a_draw_in_the_script_is_named(monkeypatch: Any) -> None:
    session, watch = _watch(monkeypatch)
    watch.drawn(early_draws.TF_GLOBAL, sys._getframe())
    assert list(session.facts) == [early_draws.FACT_PREFIX + "tf_global_seed"]


def test_a_library_drawing_while_the_script_imports_it_is_not_the_script(
        monkeypatch: Any, tmp_path: Path) -> None:
    # a library whose import builds a layer (draws a default seed) below the script's
    # `import` line: the script's own draws come later, or not at all
    session, watch = _watch(monkeypatch)
    (tmp_path / "drawing_library.py").write_text(
        "import sys\nimport tests.test_early_draws as t\n"
        "t.WATCH.drawn(t.KIND, sys._getframe())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "WATCH", watch, raising=False)
    monkeypatch.setattr(sys.modules[__name__], "KIND", early_draws.KERAS_DEFAULT,
                        raising=False)
    importlib.import_module("drawing_library")
    sys.modules.pop("drawing_library", None)
    assert session.facts == {}
