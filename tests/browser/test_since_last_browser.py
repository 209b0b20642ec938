"""[M30] item 5: the report's "since the last campaign" page in a real browser: self-contained, linked from the
index, a failure group one line with its members, and hostile text in a failure's message shown as text."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.helpers.browser import Tab
from tests.helpers.cli import DATA, Matrix

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
HOSTILE = "<script>alert('pwned')</script> \"quoted\" <img src=x onerror=alert(1)> \x1b[31mred\x1b[0m"
RUNTIMES = "".join(f"""
[[runtime]]
backend = "reference"
version = "{v}"
provider = {{ kind = "builtin" }}
components = {{ matrix-reference = "{v}" }}
""" for v in ("0.1.0", "0.2.0"))  # fmt: skip


def catalog(faults: str) -> str:
    return RUNTIMES + f"""
[[case]]
name = "flips"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 20
launch = {{ lifecycle = false, faults = [{faults}] }}
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("since-last")
    m = Matrix(home=home, db_path=home / "matrix.db")
    for faults, status in (("", 0), ('"crash-at-start"', 1)):
        (home / "cases.toml").write_text(catalog(faults))
        synced = m.subprocess("catalog", "sync", str(DATA / "backends.toml"), str(DATA / "markers.toml"),
                              str(home / "cases.toml"))  # fmt: skip
        assert synced.returncode == 0, synced.stderr
        run = m.subprocess("run", "--backend", "reference", "--max-attempts", "1", "-j", "2", "--no-report", "-q",
                           timeout=240)  # fmt: skip
        assert run.returncode == status, run.stdout + run.stderr
    # Hostile text where an engine's words land: the failure's message, different ports on each runtime.
    with sqlite3.connect(m.db_path) as conn:
        conn.execute("UPDATE cell_run SET message = ? || ' on 127.0.0.1:' || (40000 + id) || char(10) || 'tail' "
                     "WHERE status = 'failed'", (HOSTILE,))  # fmt: skip
    out = home / "report"
    assert m("report", "--out", str(out)).exit_code == 0
    return out


def test_the_since_last_page_groups_failures_and_keeps_hostile_text_text(report: Path, browser: Tab) -> None:
    page = report / "since-last.html"
    load = browser.load(page.as_uri())
    assert load.errors == [] and load.requests == [page.as_uri()]  # nothing fetched: self-contained
    assert browser.evaluate(
        "[document.scripts.length, document.images.length, document.querySelectorAll('iframe,object,embed').length]"
    ) == [0, 0, 0]
    text = browser.evaluate("document.body.innerText")
    assert "Since the last campaign: campaign 1 → campaign 2" in text
    assert "<script>alert('pwned')</script>" in text and "<img src=x onerror=alert(<n>)>" in text
    assert "\x1b" not in text
    # Both runtimes' failures are one signature: one row, two members, the ports normalised away.
    rows = browser.evaluate(
        "[...document.querySelectorAll('table.diff-groups tbody tr')].map(r => [r.cells[0].innerText, "
        "r.cells[1].innerText, r.cells[2].querySelectorAll('div').length])"
    )
    assert len(rows) == 1, rows
    count, sig, members = rows[0]
    assert count == "2" and members == 2 and sig.endswith("on <host>:<port>") and sig.startswith("startup: <script>")
    browser.screenshot(ARTIFACTS / "since-last.png", full_page=True)
    # A member links to its cell on the runtime page.
    link = browser.page.locator("table.diff-groups a").first
    assert (link.get_attribute("href") or "").startswith("runtime-reference-0.1.0.html#")


def test_the_index_links_the_since_last_page(report: Path, browser: Tab) -> None:
    load = browser.load((report / "index.html").as_uri())
    assert load.errors == []
    browser.page.locator("a[href='since-last.html']").click()
    browser.page.wait_for_load_state()
    assert browser.page.url.endswith("/since-last.html")
    assert browser.evaluate("document.querySelector('h1').innerText").startswith("Since the last campaign")
