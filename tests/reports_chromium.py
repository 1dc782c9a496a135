"""A small headless-Chromium driver for the HTML report tests, speaking the DevTools protocol on a pipe.

Chromium started with ``--remote-debugging-pipe`` reads DevTools commands from file descriptor 3 and
writes replies and events to descriptor 4, one JSON message per NUL-terminated frame. That is all a test
needs to load a page, collect console messages, uncaught exceptions, log entries (CSP violations, failed
loads) and network requests, evaluate DOM queries and take a screenshot, with no dependency beyond the
browser itself (Debian's ``chromium`` package; never a downloaded one).

Run as a script to save the README screenshot of the example report::

    .venv/bin/python tests/reports_chromium.py docs/report-screenshot.png
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Where the tests look for the browser; FLAMIA_VERIFY_CHROMIUM overrides it on other systems.
CHROMIUM = os.environ.get("FLAMIA_VERIFY_CHROMIUM", "/usr/bin/chromium")

#: Flags for a quiet, offline, root-safe headless browser.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # CI runs as root, where the sandbox refuses to start
    "--disable-gpu",
    "--disable-dev-shm-usage",  # containers often mount a tiny /dev/shm; large pages would crash the tab
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--no-first-run",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-pipe",
)


class DevToolsError(RuntimeError):
    """A DevTools command failed, timed out, or the browser went away."""


@dataclass
class PageRecord:
    """What a page did while loading: everything a 'no errors' assertion looks at."""

    console: list[tuple[str, str]] = field(default_factory=list)  # (type, text) of console.* calls
    exceptions: list[str] = field(default_factory=list)  # uncaught exceptions
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (level, source, text): CSP, failed loads
    requests: list[str] = field(default_factory=list)  # every URL the page asked for

    @property
    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error- or warning-level log entries, as lines."""
        out = [f"console.{kind}: {text}" for kind, text in self.console if kind in ("error", "assert", "warning")]
        out += [f"exception: {text}" for text in self.exceptions]
        out += [f"log {level} ({source}): {text}" for level, source, text in self.log if level in ("error", "warning")]
        return out


def _high_fd(fd: int) -> int:
    """Move `fd` above 9 (close-on-exec) so that dup2 onto 3 and 4 never meets its own source."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class Chromium:
    """A headless Chromium process driven over ``--remote-debugging-pipe``; use as a context manager."""

    def __init__(self, executable: str = CHROMIUM, *, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="flamia-chromium-")
        self.log_path = Path(self._profile.name) / "chromium.log"
        cmd_r, self._cmd_w = (_high_fd(fd) for fd in os.pipe())
        self._res_r, res_w = (_high_fd(fd) for fd in os.pipe())
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        argv = [executable, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}/profile", "about:blank"]
        try:
            self.pid = os.posix_spawn(
                executable,
                argv,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, log_fd, 1),
                    (os.POSIX_SPAWN_DUP2, log_fd, 2),
                    (os.POSIX_SPAWN_DUP2, cmd_r, 3),
                    (os.POSIX_SPAWN_DUP2, res_w, 4),
                ],
                setpgroup=0,  # its own process group: cleanup reaches the renderer and helpers too
            )
        finally:
            for fd in (cmd_r, res_w, log_fd):
                os.close(fd)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self._targets: dict[str, str] = {}  # session -> target (tab)
        self._closed = False

    # -- protocol -----------------------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DevToolsError(f"no reply from Chromium within {self.timeout} s; log: {self._log_tail()}")
            ready, _, _ = select.select([self._res_r], [], [], left)
            if ready:
                chunk = os.read(self._res_r, 1 << 20)
                if not chunk:
                    raise DevToolsError(f"Chromium closed its DevTools pipe; log: {self._log_tail()}")
                self._buffer += chunk
        frame, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(frame)

    def call(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None) -> dict[str, Any]:
        """Send one command and return its result; events that arrive meanwhile are kept for `wait_event`."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._cmd_w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def wait_event(self, method: str, *, session: str | None = None) -> dict[str, Any]:
        """The first event `method` (of `session`) not yet consumed, waiting for it if needed."""
        deadline = time.monotonic() + self.timeout
        while True:
            for i, event in enumerate(self._events):
                if event["method"] == method and (session is None or event.get("sessionId") == session):
                    return self._events.pop(i)
            self._events.append(self._read_message(deadline))

    def drain(self, session: str, settle: float = 0.2) -> list[dict[str, Any]]:
        """All events of `session` received so far, after waiting `settle` seconds for stragglers."""
        deadline = time.monotonic() + settle
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._res_r], [], [], left)[0]:
                break
            chunk = os.read(self._res_r, 1 << 20)
            if not chunk:
                break
            self._buffer += chunk
            while b"\0" in self._buffer:
                frame, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(frame)
                if "method" in message:
                    self._events.append(message)
        mine = [e for e in self._events if e.get("sessionId") == session]
        self._events = [e for e in self._events if e.get("sessionId") != session]
        return mine

    # -- pages --------------------------------------------------------------------------------------

    def open(self, url: str, *, width: int = 1280, height: int = 900) -> tuple[str, PageRecord]:
        """Load `url` in a new tab of the given viewport; returns the tab's session and what the page did."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self._targets[session] = target
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=session)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        self.drain(session, settle=0.0)  # forget about:blank's own events
        navigated = self.call("Page.navigate", {"url": url}, session=session)
        if navigated.get("errorText"):
            raise DevToolsError(f"navigation to {url} failed: {navigated['errorText']}")
        self.wait_event("Page.loadEventFired", session=session)
        record = PageRecord()
        for event in self.drain(session):
            params = event.get("params", {})
            method = event["method"]
            if method == "Runtime.consoleAPICalled":
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                record.console.append((params.get("type", ""), text))
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                record.exceptions.append(details.get("exception", {}).get("description") or details.get("text", ""))
            elif method == "Log.entryAdded":
                entry = params.get("entry", {})
                record.log.append((entry.get("level", ""), entry.get("source", ""), entry.get("text", "")))
            elif method == "Network.requestWillBeSent":
                record.requests.append(params.get("request", {}).get("url", ""))
        return session, record

    def close_page(self, session: str) -> None:
        """Close the tab of `session`."""
        target = self._targets.pop(session, None)
        if target:
            self.call("Target.closeTarget", {"targetId": target})
            self.drain(session, settle=0.0)

    def evaluate(self, session: str, expression: str) -> Any:
        """The value of a JavaScript expression in the page (DevTools evaluation, not subject to the page CSP)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
        if "exceptionDetails" in result:
            raise DevToolsError(f"evaluating {expression!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, session: str, path: str | os.PathLike[str], *, height: int | None = None) -> Path:
        """Save a PNG of the page from its top: the viewport, or `height` CSS pixels of it."""
        self.call("Page.bringToFront", session=session)  # a background tab may never paint a frame
        params: dict[str, Any] = {"format": "png"}
        if height is not None:
            width = self.evaluate(session, "document.documentElement.clientWidth")
            clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
            params.update(captureBeyondViewport=True, clip=clip)
        data = self.call("Page.captureScreenshot", params, session=session)["data"]
        out = Path(path)
        out.write_bytes(base64.b64decode(data))
        return out

    # -- lifetime -----------------------------------------------------------------------------------

    def _log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:] or "(empty)"
        except OSError:
            return "(unreadable)"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.call("Browser.close")
        except (DevToolsError, OSError):
            pass
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.killpg(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        for fd in (self._cmd_w, self._res_r):
            os.close(fd)
        self._profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def save_screenshot(html_path: Path, png_path: Path, *, height: int = 2200) -> Path:
    """Render `html_path` in headless Chromium and save the top `height` pixels as `png_path`."""
    with Chromium() as browser:
        session, record = browser.open(html_path.resolve().as_uri())
        if record.errors:
            raise DevToolsError("the page reported errors: " + "; ".join(record.errors))
        return browser.screenshot(session, png_path, height=height)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from reports_examples import example_report

    from flamia_verify.reports import write_reports

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/report-screenshot.png")
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_reports(example_report(), Path(tmp))
        print(save_screenshot(paths["html"], target))
