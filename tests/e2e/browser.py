"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
no port, no websocket library): open a page, collect what its console reports, evaluate
expressions, take a screenshot. Every wait has a deadline."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT = 60.0


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _as_fds_3_and_4(read_end: int, write_end: int) -> None:
    """In the child: the pipe ends as fds 3 and 4 (inheritable; every other pipe end is
    close-on-exec). Moved above 10 first, so neither can overwrite the other."""
    high_r, high_w = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (read_end, write_end))
    os.dup2(high_r, 3)
    os.dup2(high_w, 4)


class Browser:
    def __init__(self, executable: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="nondet-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # fds 3 and 4 are where --remote-debugging-pipe reads and writes
        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--hide-scrollbars", "--remote-debugging-pipe",
             f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=lambda: _as_fds_3_and_4(to_browser_r, from_browser_w))
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.session = ""

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=TIMEOUT)
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: bool = True) -> dict[str, Any]:
        """One command; its result (events that arrive meanwhile are kept)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        reply = self._until(lambda m: m.get("id") == self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def wait_event(self, method: str) -> dict[str, Any]:
        seen = next((e for e in self.events if e.get("method") == method), None)
        return seen or self._until(lambda m: m.get("method") == method)

    def _until(self, wanted: Any) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT
        while True:
            while b"\0" in self._buffer:
                raw, _, self._buffer = self._buffer.partition(b"\0")
                message = json.loads(raw)
                if "method" in message:
                    self.events.append(message)
                if wanted(message):
                    return dict(message)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the browser did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("the browser closed its pipe")
                self._buffer += chunk

    def open(self, page: Path, width: int = 1000, height: int = 1400) -> None:
        """A new tab with the page loaded, console and log collected."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.send("Target.attachToTarget",
                             {"targetId": target["targetId"], "flatten": True}, session=False)
        self.session = attached["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.navigate", {"url": page.resolve().as_uri()})
        self.wait_event("Page.loadEventFired")

    def console_errors(self) -> list[str]:
        """Errors the page reported: console.error, uncaught exceptions, and the browser's
        own log entries (blocked resources, CSP violations) at warning level or above."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in (
                    "error", "assert", "warning"):
                out.append(json.dumps(p.get("args")))
            elif e.get("method") == "Runtime.exceptionThrown":
                out.append(json.dumps(p.get("exceptionDetails")))
            elif e.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") in (
                    "error", "warning"):
                out.append(p["entry"].get("text", ""))
        return out

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, down_to: str = "") -> bytes:
        """The whole page as PNG, or its top down to the bottom of the element ``down_to``
        (a CSS selector)."""
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": True}
        if down_to:
            bottom = self.evaluate(f"document.querySelector({json.dumps(down_to)})"
                                   ".getBoundingClientRect().bottom + window.scrollY")
            width = self.evaluate("document.documentElement.scrollWidth")
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": bottom + 16, "scale": 1}
        data = self.send("Page.captureScreenshot", params)
        return base64.b64decode(data["data"])


def main() -> None:
    """``python -m tests.e2e.browser PAGE.html OUT.png``: the README's screenshot (the top
    of the report, down to the growth chart)."""
    import sys

    page, out = Path(sys.argv[1]), Path(sys.argv[2])
    executable = find_browser()
    if executable is None:
        sys.exit("no Chromium: apt-get install -y chromium")
    with Browser(executable) as browser:
        browser.open(page)
        out.write_bytes(browser.screenshot(down_to="#growth-chart"))


if __name__ == "__main__":
    main()
