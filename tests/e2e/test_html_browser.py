"""The HTML report of a real run, opened in a real headless Chromium: it renders without
console errors, its growth chart has one point per step compared, the finding's op and line
are on the page, and a screenshot is not blank. A missing browser fails the test: `.ci/run`
installs Chromium (`apt-get install -y chromium`)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_cli
from tests.e2e.browser import Browser, find_browser

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e

SCRIPT = FIXTURES / "torch" / "index_put_backward.py"


def test_html_report_of_a_real_run_renders_in_chromium(tmp_path: Path) -> None:
    browser = find_browser()
    if browser is None:
        pytest.fail("no Chromium on this machine: `apt-get install -y chromium` "
                    "(.ci/run installs it before the tests)")
    from PIL import Image

    page, report = tmp_path / "report.html", tmp_path / "report.json"
    result = run_cli("run", "--no-verify", "--out", str(tmp_path / "out"), "--json", str(report),
                     "--html", str(page), str(SCRIPT))
    assert result.returncode == 1, result.stderr
    data = json.loads(report.read_text())
    steps = [g["step"] for g in data["growth"]]
    finding = data["first_divergence"]
    first = next(g["step"] for g in data["growth"] if g["differing"])
    with Browser(browser) as chromium:
        chromium.open(page)
        assert chromium.console_errors() == []
        drawn = chromium.evaluate(
            "[...document.querySelectorAll('#growth-chart g.loss circle.point')]"
            ".map(c => Number(c.dataset.step))")
        assert drawn == steps and len(steps) >= 2
        marker = chromium.evaluate(
            "document.querySelector('#growth-chart line.marker').dataset.step")
        assert marker == str(first)
        text = chromium.evaluate("document.body.innerText")
        assert finding["op"] == "aten.index_put.default" and finding["op"] in text
        assert finding["source"] in text and finding["source_text"].strip() in text
        width = chromium.evaluate("document.querySelector('#growth-chart svg')"
                                  ".getBoundingClientRect().width")
        assert width > 300  # the chart is laid out, not collapsed
        shot = Image.open(io.BytesIO(chromium.screenshot())).convert("RGB")
    colours = shot.getcolors(maxcolors=1 << 24) or []
    white = sum(n for n, colour in colours if colour == (255, 255, 255))
    inked = 1 - white / (shot.width * shot.height)
    assert shot.width >= 900 and inked > 0.02, f"screenshot looks blank ({inked:.3%} inked)"
    assert len(colours) > 50  # text, the red verdict, the chart's colours
