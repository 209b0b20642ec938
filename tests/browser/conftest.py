"""Fixtures of the browser tests: one headless tab per module (see `tests.helpers.browser`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.browser import Tab, open_tab, require_browser_here


@pytest.fixture(scope="session", autouse=True)
def require_browser() -> None:
    require_browser_here()


@pytest.fixture(scope="module")
def browser() -> Iterator[Tab]:
    with open_tab() as tab:
        yield tab
