"""The report in a real browser: Playwright drives Debian's headless Chromium over every page type from file://.

Each page must load with no console error, no exception and no request other than its own file (the
pages are self-contained), contain no script element even though the results hold hostile text, and
show that text as text. Screenshots of every page are kept in tests/browser/artifacts/ (git-ignored).
The results come from real reference runs, as in tests/e2e/test_report_reference.py.
"""

from __future__ import annotations

import re
import sqlite3
import struct
from pathlib import Path

import pytest

from tests.helpers.browser import HEIGHT, WIDTH, Tab
from tests.helpers.cli import DATA, Matrix

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
HOSTILE = "<script>alert('pwned')</script> \"quoted\" <img src=x onerror=alert(1)> \x1b[31mred\x1b[0m"
CASES = """
[[runtime]]
backend = "reference"
version = "0.1.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.1.0" }

[[runtime]]
backend = "reference"
version = "0.2.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.2.0" }

[[case]]
name = "healthy"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e", "pre_merge"]
startup_timeout_s = 20

[[case]]
name = "on_gpu"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_1", "e2e", "pre_merge"]
startup_timeout_s = 20
launch = { device = "cuda" }

[[case]]
name = "aggregated"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e", "pre_merge"]
startup_timeout_s = 20
launch = { faults = ["same-worker-id"] }
"""


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("browser")
    m = Matrix(home=home, db_path=home / "matrix.db")
    (home / "cases.toml").write_text(CASES)
    files = [str(home / "cases.toml")] + [str(DATA / n) for n in ("backends.toml", "markers.toml", "gates.toml")]
    assert m.subprocess("catalog", "sync", *files).returncode == 0
    run = m.subprocess("run", "--backend", "reference", "--jobs", "2", timeout=240)
    assert run.returncode == 1, run.stdout + run.stderr  # "aggregated" fails on purpose
    # A repeat of the healthy case: its trend chart shows the spread of two runs per version.
    again = m.subprocess("run", "--backend", "reference", "--case", "healthy", "--jobs", "2", timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    # Hostile text where engines put arbitrary bytes: a real log and a completion (see the e2e report test).
    row_id, log_dir = m.sql(
        'SELECT cell_run.id, log_dir FROM cell_run JOIN "case" ON case_id = "case".id WHERE name = \'healthy\' '
        "ORDER BY cell_run.id DESC LIMIT 1"
    )[0]
    with (Path(str(log_dir)) / "decode.log").open("a") as log:
        log.write((HOSTILE + "\n") * 20_000)
    with sqlite3.connect(m.db_path) as conn:
        conn.execute("UPDATE cell_run SET completion_excerpt = ? WHERE id = ?", (HOSTILE, row_id))
    out = home / "report"
    assert m("report", "--out", str(out)).exit_code == 0
    assert m("gate", "reference", "0.2.0", "--policy", "pre_merge", "--html", str(out / "gate.html")).exit_code == 1
    return out


PAGES = {
    "index": "index.html",
    "runtime": "runtime-reference-0.2.0.html",
    "campaign": "campaign-1.html",
    "runtime-gate": "gate-reference-0.2.0-release.html",
    "compare": "compare-reference_0.1.0-vs-reference_0.2.0.html",
    "gate": "gate.html",
}


@pytest.mark.parametrize("kind", sorted(PAGES))
def test_page_loads_clean_and_self_contained(report: Path, browser: Tab, kind: str) -> None:
    page = browser.load((report / PAGES[kind]).as_uri())
    assert page.errors == [], page.errors
    assert page.requests and all(url.startswith("file://") for url in page.requests), page.requests
    assert page.requests == [(report / PAGES[kind]).as_uri()]  # no CSS, font, image or script fetched
    counts = browser.evaluate(
        "[document.scripts.length, document.images.length, document.querySelectorAll('iframe,object,embed').length]"
    )
    assert counts == [0, 0, 0]
    shot = browser.screenshot(ARTIFACTS / f"{kind}.png")
    assert png_size(shot) == (WIDTH, HEIGHT)
    assert len(shot) > 10_000  # not a blank page


def test_index_screenshot_shows_the_grid(report: Path, browser: Tab) -> None:
    browser.load((report / "index.html").as_uri())
    grid = browser.evaluate(
        """(() => { const t = document.querySelector('table.grid'); const r = t.getBoundingClientRect();
        return {top: r.top, left: r.left, width: r.width, height: r.height,
                labels: [...t.querySelectorAll('td.cell')].map(td => td.innerText.split('\\n')[0]),
                svg: t.querySelectorAll('svg polyline').length,
                colour: getComputedStyle(t.querySelector('td.st-passed')).backgroundColor}; })()"""
    )
    assert 0 <= grid["top"] < HEIGHT and grid["width"] > 200 and grid["height"] > 40  # on the first screen
    assert "PASS" in grid["labels"] and "FAIL" in grid["labels"]
    assert grid["svg"] >= 2
    assert grid["colour"] not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)")  # the status is coloured too
    browser.screenshot(ARTIFACTS / "index-full.png", full_page=True)


def test_hostile_text_renders_as_text(report: Path, browser: Tab) -> None:
    browser.load((report / PAGES["runtime"]).as_uri())
    text = browser.evaluate("document.body.innerText")
    assert "<script>alert('pwned')</script>" in text
    assert browser.evaluate("document.querySelectorAll('details.log').length") >= 3
    browser.evaluate("document.querySelectorAll('details.log').forEach(d => d.open = true)")
    assert browser.evaluate("document.body.innerText").count("alert('pwned')") > 100
    browser.screenshot(ARTIFACTS / "runtime-logs-open.png")


def test_the_harness_sees_console_errors_and_external_requests(tmp_path: Path, browser: Tab) -> None:
    """The checks above mean something only if a broken page fails them."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><title>bad</title><link rel='stylesheet' href='http://127.0.0.1:9/x.css'>"
        "<script>console.error('boom'); undefined_function();</script>"
    )
    page = browser.load(bad.as_uri())
    assert any("boom" in e for e in page.errors)
    assert any("undefined_function" in e for e in page.errors)
    assert any(url.startswith("http://127.0.0.1:9/") for url in page.requests)


# Text a reader must never meet: Python's reprs of nothing and of lists.
REPRS = re.compile(r"\bNone\b|\['")
# A time of day must carry its zone: Z, +00:00, or a fraction and then one of those.
TIME = re.compile(r"\d\d:\d\d:\d\d(\.\d+)?(?P<zone>Z|[+-]\d\d:\d\d)?")


def test_index_shows_each_runtimes_gate_verdicts_and_trend_charts(report: Path, browser: Tab) -> None:
    page = browser.load((report / "index.html").as_uri())
    assert page.errors == [], page.errors
    columns = browser.evaluate(
        """[...document.querySelectorAll('table.grid th.version')].map(th => ({
            version: th.querySelector('a').innerText,
            notes: [...th.querySelectorAll('.note')].map(n => n.innerText),
            gates: [...th.querySelectorAll('.gate')].map(g => ({text: g.innerText,
                href: g.querySelector('a') && g.querySelector('a').getAttribute('href'),
                title: g.querySelector('.verdict-badge').getAttribute('title')}))}))"""
    )
    by_version = {c["version"]: c for c in columns}
    assert set(by_version) == {"0.1.0", "0.2.0"}
    # Counts in words, skips included, never "1/3 passed".
    assert by_version["0.2.0"]["notes"][1] == "1 passed, 1 failed, 1 skipped"
    # One verdict per policy of the catalog, each a link to its reasons.
    gates = {g["text"]: g for g in by_version["0.2.0"]["gates"]}
    assert set(gates) == {"pre_merge NO-GO", "release NO-GO"}  # aggregated fails, on_gpu was skipped
    assert "blocking reason(s); first: " in gates["release NO-GO"]["title"]
    browser.screenshot(ARTIFACTS / "index-verdicts.png")

    # A failed cell names its failure kind and check; a skipped one its reason.
    cells = browser.evaluate("[...document.querySelectorAll('table.grid td.cell')].map(td => td.innerText)")
    assert any("FAIL" in c and "validation: worker_ids_distinct" in c for c in cells), cells
    assert any("SKIP" in c and "needs 1 GPU, host has 0" in c for c in cells), cells

    # The healthy case has timings on both versions, two runs each: a chart with both series and spreads.
    chart = browser.evaluate(
        """(() => { const row = [...document.querySelectorAll('table.grid tbody tr')]
                      .find(r => r.querySelector('th.case').innerText.startsWith('healthy'));
            const svg = row.querySelector('svg.trend'); const r = svg.getBoundingClientRect();
            return {panels: [...svg.querySelectorAll('g')].map(g => g.getAttribute('class')),
                    lines: svg.querySelectorAll('polyline').length, points: svg.querySelectorAll('circle').length,
                    spreads: [...svg.querySelectorAll('line.spread')]
                               .map(l => l.getAttribute('y1') !== l.getAttribute('y2')),
                    labels: [...svg.querySelectorAll('text')].map(t => t.textContent),
                    width: r.width, height: r.height}; })()"""
    )
    assert chart["panels"] == ["ready", "request"] and chart["lines"] == 2 and chart["points"] == 4
    assert any(chart["spreads"])  # two runs of one version do not take exactly the same time
    assert "0.1.0" in chart["labels"] and "0.2.0" in chart["labels"]
    assert all(label.endswith(" s") for label in chart["labels"][:4])  # each panel's range, in seconds
    assert chart["width"] > 150 and chart["height"] > 60
    browser.page.locator("svg.trend").first.screenshot(path=str(ARTIFACTS / "trend-chart.png"))

    # The verdict is one click from its reasons.
    browser.page.click("th.version:has-text('0.2.0') .gate:has-text('release') a")
    browser.page.wait_for_load_state("load")
    assert browser.page.url.endswith("/gate-reference-0.2.0-release.html")
    gate = browser.evaluate(
        "({verdict: document.querySelector('.verdict').innerText,"
        " reasons: [...document.querySelectorAll('table.reasons tbody tr')].map(r => r.innerText)})"
    )
    assert gate["verdict"] == "NO-GO"
    assert any("worker_ids_distinct" in r for r in gate["reasons"]), gate
    browser.screenshot(ARTIFACTS / "gate-from-index.png")


@pytest.mark.parametrize("kind", ["index", "campaign", "runtime-gate", "compare", "gate"])
def test_pages_show_no_python_reprs_and_every_time_with_its_zone(report: Path, browser: Tab, kind: str) -> None:
    browser.load((report / PAGES[kind]).as_uri())
    text = browser.evaluate("document.body.innerText")
    assert not REPRS.search(text), REPRS.search(text)
    times = list(TIME.finditer(text))
    assert times or kind in ("compare", "gate", "runtime-gate")
    assert [m.group(0) for m in times if not m.group("zone")] == []


def test_the_campaign_page_says_why_a_cell_was_skipped(report: Path, browser: Tab) -> None:
    browser.load((report / PAGES["campaign"]).as_uri())
    rows = browser.evaluate("[...document.querySelectorAll('table tbody tr')].map(r => r.innerText)")
    assert any("on_gpu" in r and "SKIP" in r and "needs 1 GPU, host has 0" in r for r in rows), rows
