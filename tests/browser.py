"""Open a local HTML file in headless Chromium (Debian's ``chromium``) and report what a reader would meet: console
errors, uncaught exceptions, network requests, and each ``<img>``'s natural size; optionally a screenshot.

Chromium is driven through its DevTools protocol over ``--remote-debugging-pipe`` (NUL-separated JSON on the
child's file descriptors 3 and 4): no port, no extra Python package. Console errors are every
``Runtime.consoleAPICalled`` of type error/assert, every ``Runtime.exceptionThrown`` and every
``Log.entryAdded`` of level error (failed loads, blocked requests, bad images the browser logs).

Used by tests/test_report_html.py, and for docs/img's screenshots::

    python tests/browser.py REPORT.html OUT.png [WIDTH] [HEIGHT]
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"

_IMAGES_JS = ("JSON.stringify({title: document.title, body: document.body ? document.body.innerText.length : 0, "
              "images: Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight, "
              "i.alt, i.src.slice(0, 30)])})")


@dataclass
class PageCheck:
    title: str = ""
    text_chars: int = 0
    #: (complete, naturalWidth, naturalHeight, alt, first 30 characters of src) per <img>
    images: list[tuple[bool, int, int, str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    screenshot: bytes | None = None


class _Pipe:
    def __init__(self, proc: subprocess.Popen, write_fd: int, read_fd: int):
        self.proc, self.w, self.r = proc, write_fd, read_fd
        self.buf = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            ready, _, _ = select.select([self.r], [], [], left)
            if ready:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the DevTools pipe (exit {self.proc.poll()})")
                self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 20.0) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            got = self._read_message(deadline)
            if got.get("id") == self.next_id:
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                return got.get("result", {})
            self.events.append(got)

    def wait_for(self, method: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        if any(e.get("method") == method for e in self.events):
            return
        while True:
            got = self._read_message(deadline)
            self.events.append(got)
            if got.get("method") == method:
                return


def _errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description", "")))
                                                               for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            out.append("exception: " + str(p.get("exceptionDetails", {}).get("text")))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append("log: " + str(p["entry"].get("text")) + " " + str(p["entry"].get("url", "")))
    return out


def check_page(path: Path, *, width: int = 1200, height: int = 900, screenshot_height: int | None = None,
               open_details: bool = False, screenshot_at: str | None = None, timeout: float = 30.0) -> PageCheck:
    """Load ``path`` in headless Chromium at ``width`` x ``height`` CSS pixels and return what it met; with
    ``screenshot_height``, a PNG that many pixels high of the page's top, or from the top of the first element
    the CSS selector ``screenshot_at`` matches (``open_details``: every <details> opened first)."""
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()

    def child() -> None:  # the browser reads commands on fd 3 and writes answers on fd 4
        a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
        os.dup2(a, 3)
        os.dup2(b, 4)

    profile = tempfile.mkdtemp(prefix="fedsight-chromium-")
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars", "--remote-debugging-pipe",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            pass_fds=(3, 4), preexec_fn=child)
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    pipe = _Pipe(proc, to_chrome_w, from_chrome_r)
    out = PageCheck()
    try:
        targets = pipe.call("Target.getTargets", timeout=timeout)["targetInfos"]
        page = next(t["targetId"] for t in targets if t["type"] == "page")
        session = pipe.call("Target.attachToTarget", {"targetId": page, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            pipe.call(f"{domain}.enable", session=session)
        pipe.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=session)
        pipe.events.clear()
        pipe.call("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
        pipe.wait_for("Page.loadEventFired", timeout=timeout)
        if open_details:
            pipe.call("Runtime.evaluate", {"expression": "document.querySelectorAll('details').forEach("
                                           "d => d.open = true)"}, session=session)
        value = pipe.call("Runtime.evaluate", {"expression": _IMAGES_JS, "returnByValue": True},
                          session=session)["result"]["value"]
        doc = json.loads(value)
        out.title, out.text_chars = doc["title"], doc["body"]
        out.images = [tuple(i) for i in doc["images"]]  # type: ignore[misc]
        if screenshot_height:
            top = 0
            if screenshot_at:
                top = pipe.call("Runtime.evaluate", {
                    "expression": f"document.querySelector({json.dumps(screenshot_at)}).getBoundingClientRect().top"
                                  " + window.scrollY", "returnByValue": True}, session=session)["result"]["value"]
            shot = pipe.call("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": max(0, top - 8), "width": width, "height": screenshot_height, "scale": 1}},
                session=session, timeout=timeout)
            import base64

            out.screenshot = base64.b64decode(shot["data"])
        time.sleep(0.2)  # let late log entries (a failed image decode) arrive
        pipe.call("Runtime.evaluate", {"expression": "1"}, session=session)
        out.errors = _errors(pipe.events)
        out.requests = [e["params"]["request"]["url"][:80] for e in pipe.events
                        if e.get("method") == "Network.requestWillBeSent"]
        try:
            pipe.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError):
            pass
    finally:
        os.close(to_chrome_w)
        os.close(from_chrome_r)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    return out


if __name__ == "__main__":
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    w = int(sys.argv[3]) if len(sys.argv) > 3 else 1200
    h = int(sys.argv[4]) if len(sys.argv) > 4 else 1600
    page = check_page(src, width=w, screenshot_height=h)
    assert page.screenshot is not None
    dst.write_bytes(page.screenshot)
    print(f"{dst}: {len(page.screenshot)} bytes; {len(page.images)} images; errors: {page.errors or 'none'}")
