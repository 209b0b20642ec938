"""A small Chrome DevTools Protocol client: headless Chromium, console errors, requests and screenshots.

No Node and no driver binary: Chromium is started with ``--remote-debugging-port=0``, the port it picked
is read from ``DevToolsActivePort`` in its fresh profile directory, and one page target is driven over a
websocket (the ``websockets`` package's synchronous client). Every event is kept, so a test can assert
that a page logged no console error, threw nothing and requested nothing but ``file://`` URLs.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

CHROMIUM = "/usr/bin/chromium"
# Flags for a sandboxed CI machine without a network or a display; a fresh profile each time.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
)


def chromium_path() -> str | None:
    found = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    return found


@dataclass
class PageLoad:
    """What one navigation produced."""

    url: str
    console: list[dict[str, Any]] = field(default_factory=list)  # Runtime.consoleAPICalled params
    exceptions: list[dict[str, Any]] = field(default_factory=list)  # Runtime.exceptionThrown params
    log_entries: list[dict[str, Any]] = field(default_factory=list)  # Log.entryAdded entries
    requests: list[str] = field(default_factory=list)  # every URL the page requested
    failed_requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions, error log entries and failed loads, as text."""
        found = [
            " ".join(str(arg.get("value", arg.get("description", ""))) for arg in c.get("args", []))
            for c in self.console
            if c.get("type") in ("error", "assert")
        ]
        for thrown in self.exceptions:
            details = thrown.get("exceptionDetails", {})
            found.append(f"{details.get('text', '')} {details.get('exception', {}).get('description', '')}".strip())
        found += [f"{e.get('source')}: {e.get('text')} {e.get('url', '')}" for e in self.log_entries
                  if e.get("level") == "error"]  # fmt: skip
        found += [f"failed to load: {f.get('errorText')}" for f in self.failed_requests]
        return found


class Browser:
    """Headless Chromium with one tab; use as a context manager."""

    def __init__(self, width: int = 1400, height: int = 900, timeout: float = 30.0) -> None:
        self.width, self.height, self.timeout = width, height, timeout
        self._ids = itertools.count(1)
        self._profile = Path(tempfile.mkdtemp(prefix="matrix-chromium-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._ws: ClientConnection | None = None
        self._session = ""
        self._events: list[dict[str, Any]] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Browser:
        binary = chromium_path()
        if binary is None:
            raise RuntimeError("chromium is not installed")
        self._proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={self.width},{self.height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        port_file = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not open its DevTools port (exit code {self._proc.poll()})")
            time.sleep(0.05)
        port, path = port_file.read_text().splitlines()[:2]
        self._ws = self._stack.enter_context(
            connect(f"ws://127.0.0.1:{port}{path}", max_size=64 * 2**20, open_timeout=self.timeout)
        )
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call(
            "Emulation.setDeviceMetricsOverride", session=True, width=self.width, height=self.height,
            deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        shutil.rmtree(self._profile, ignore_errors=True)

    def _recv(self, deadline: float) -> dict[str, Any]:
        assert self._ws is not None
        remaining = max(0.01, deadline - time.monotonic())
        message: dict[str, Any] = json.loads(self._ws.recv(timeout=remaining))
        return message

    def call(self, method: str, *, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its answer; events that arrive meanwhile are kept."""
        assert self._ws is not None
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        self._ws.send(json.dumps(message))
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._recv(deadline)
            if reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self._events.append(reply)

    def load(self, url: str) -> PageLoad:
        """Navigate, wait for the load event and a quiet moment, and collect what happened."""
        self._events.clear()
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + self.timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            self._events.append(self._recv(deadline))
        quiet = time.monotonic() + 0.3  # late console messages
        while True:
            try:
                self._events.append(self._recv(quiet))
            except TimeoutError:
                break
        page = PageLoad(url)
        for event in self._events:
            params = event.get("params", {})
            method = event.get("method")
            if method == "Runtime.consoleAPICalled":
                page.console.append(params)
            elif method == "Runtime.exceptionThrown":
                page.exceptions.append(params)
            elif method == "Log.entryAdded":
                page.log_entries.append(params.get("entry", {}))
            elif method == "Network.requestWillBeSent":
                page.requests.append(params.get("request", {}).get("url", ""))
            elif method == "Network.loadingFailed":
                page.failed_requests.append(params)
        return page

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def screenshot(self, path: Path, *, full_page: bool = False) -> bytes:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        data = base64.b64decode(self.call("Page.captureScreenshot", session=True, **params)["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return data
