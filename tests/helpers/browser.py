"""The browser for the report tests (and e2e tests that open a report): Playwright driving the system's Chromium.

Playwright is told where Chromium is (`executable_path`), so nothing is downloaded (`playwright install`
is never needed). Each load records what a test asserts on: console errors, uncaught exceptions, failed
requests and every URL the page asked for.

Without Chromium (or Playwright) the browser tests are skipped locally, with the reason in pytest's
summary; in CI (`CI=true`) they fail instead, so a runner that lost its browser cannot pass green.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
# A sandboxed CI machine has no display, no GPU and a small /dev/shm.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars", "--disable-quic"]
WIDTH, HEIGHT = 1400, 900
# Console messages can arrive just after the load event.
SETTLE_MS = 300


def chromium_path() -> str | None:
    """`MATRIX_TEST_CHROMIUM` if set (a path, or anything else to say there is none), else the system's."""
    chosen = os.environ.get("MATRIX_TEST_CHROMIUM")
    if chosen is not None:
        return chosen if Path(chosen).is_file() else None
    return shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if chromium_path() is None:
        return "chromium is not installed (Debian: apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


@dataclass
class PageLoad:
    """What one navigation produced."""

    url: str
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, failed requests
    requests: list[str] = field(default_factory=list)  # every URL the page requested


class Tab:
    """One page of a headless Chromium; `load` records what the navigation did."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self._current = PageLoad("")
        page.on("console", self._console)
        page.on("pageerror", lambda error: self._current.errors.append(f"exception: {error}"))
        page.on("request", lambda request: self._current.requests.append(request.url))
        page.on("requestfailed", lambda r: self._current.errors.append(f"failed to load {r.url}: {r.failure}"))

    def _console(self, message: Any) -> None:
        if message.type in ("error", "assert"):
            self._current.errors.append(message.text)

    def load(self, url: str) -> PageLoad:
        self._current = PageLoad(url)
        self.page.goto(url, wait_until="load")
        self.page.wait_for_timeout(SETTLE_MS)
        return self._current

    def evaluate(self, expression: str) -> Any:
        return self.page.evaluate(expression)

    def screenshot(self, path: Path, *, full_page: bool = False) -> bytes:
        path.parent.mkdir(parents=True, exist_ok=True)
        data: bytes = self.page.screenshot(path=str(path), full_page=full_page)
        return data


def require_browser_here() -> None:
    """Skip the calling test without a browser, or fail it under CI=true."""
    reason = missing_browser()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs the browser tests: {reason}", pytrace=False)
    pytest.skip(reason)


@contextmanager
def open_tab() -> Iterator[Tab]:
    """A headless Chromium with one page, closed on exit (also for tests outside this directory)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=ARGS)
        try:
            yield Tab(chromium.new_page(viewport={"width": WIDTH, "height": HEIGHT}))
        finally:
            chromium.close()
