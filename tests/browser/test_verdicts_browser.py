"""[M21] items 5 and 16 in a real Chromium, over a report of real reference runs.

* Red only where something was measured: a policy that selects nothing for a runtime is N/A (grey), a
  NO-GO known from a missing fix before anything ran is marked predicted and looks unlike a measured one.
* Layout: a grid of many versions scrolls inside its box with the case column fixed, and the page
  itself never runs off to the right; runtime pages show the gate verdicts, group identical repeated
  failures ("3 attempts, same failure") and name no raw key (`cpu_s.decode`); the compare page shows no
  literal backtick; the gate page lists the policy's rules.

Screenshots of the index, a runtime, the compare and a gate page go to tests/browser/artifacts/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.browser import Tab
from tests.helpers.cli import DATA, Matrix

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
EXTRA_VERSIONS = [f"0.{n}.0" for n in range(3, 17)]  # columns without results: a grid wider than the page
CASES = (
    "\n".join(
        f'[[runtime]]\nbackend = "reference"\nversion = "{v}"\nprovider = {{ kind = "builtin" }}\n'
        f'components = {{ matrix-reference = "{v}" }}\n'
        for v in ["0.2.0", *EXTRA_VERSIONS]
    )
    + """
[[case]]
name = "healthy"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e", "pre_merge"]
startup_timeout_s = 20

[[case]]
name = "aggregated"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e", "pre_merge"]
startup_timeout_s = 20
launch = { faults = ["same-worker-id"] }

[[case]]
name = "needs_fix"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e", "pre_merge"]
version_constraint = "==0.3.0"
requires_fixes = ["vllm#54814"]

[[gate]]
name = "weekly_only"
expression = "weekly"
description = "Selects no reference case: not applicable to any of them."
rules = {}
"""
)


@pytest.fixture(scope="module")
def verdicts_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("verdicts")
    m = Matrix(home=home, db_path=home / "matrix.db")
    (home / "cases.toml").write_text(CASES)
    files = [str(home / "cases.toml")] + [str(DATA / n) for n in ("backends.toml", "markers.toml", "gates.toml",
                                                                   "fixes.toml", "runtimes.toml")]  # fmt: skip
    synced = m.subprocess("catalog", "sync", *files)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    for version in ("0.1.0", "0.2.0"):
        run = m.subprocess("run", "--runtime", f"reference={version}", "--case", "healthy", "--case", "aggregated",
                           "--repeat", "3", "--jobs", "2", "--no-report", timeout=300)  # fmt: skip
        assert run.returncode == 1, run.stdout + run.stderr  # "aggregated" fails on purpose, three times
    out = home / "report"
    written = m.subprocess("report", "--out", str(out))
    assert written.returncode == 0, written.stderr
    return out


BADGES = """(v) => { const th = [...document.querySelectorAll('table.grid th.version')]
    .find(t => t.querySelector('a').innerText === v);
  return Object.fromEntries([...th.querySelectorAll('.gate')].map(g => {
    const b = g.querySelector('.verdict-badge'); const s = getComputedStyle(b);
    return [g.innerText.split(' ')[0], {text: b.innerText, css: b.className, title: b.getAttribute('title'),
                                        background: s.backgroundColor, border: s.borderStyle}]; })); }"""


def _badges(browser: Tab, version: str) -> dict[str, dict[str, str]]:
    """Per policy, the verdict badge under one version column: its text, class, title and look."""
    found: dict[str, dict[str, str]] = browser.page.evaluate(BADGES, version)
    return found


def test_nothing_selected_is_not_applicable_and_a_predicted_no_go_says_so(verdicts_report: Path, browser: Tab) -> None:
    page = browser.load((verdicts_report / "index.html").as_uri())
    assert page.errors == [], page.errors
    measured = _badges(browser, "0.2.0")
    assert measured["weekly_only"]["text"] == "N/A" and "verdict-na" in measured["weekly_only"]["css"]
    assert measured["weekly_only"]["background"] != measured["pre_merge"]["background"]  # grey, not red
    assert "not applicable" in measured["weekly_only"]["title"]
    assert measured["pre_merge"]["text"] == "NO-GO" and measured["pre_merge"]["border"] != "dashed"

    predicted = _badges(browser, "0.3.0")  # needs_fix lacks vllm#54814, and nothing ran on 0.3.0
    assert predicted["pre_merge"]["text"] == "NO-GO (predicted)", predicted
    assert "verdict-predicted" in predicted["pre_merge"]["css"] and predicted["pre_merge"]["border"] == "dashed"
    assert predicted["pre_merge"]["background"] != measured["pre_merge"]["background"]
    assert "predicted, not measured" in predicted["pre_merge"]["title"]
    assert _badges(browser, "0.4.0")["pre_merge"]["text"] == "INCOMPLETE"  # nothing ran, nothing known wrong

    browser.load((verdicts_report / "gate-reference-0.3.0-pre_merge.html").as_uri())
    text = browser.evaluate("document.body.innerText")
    assert "NO-GO (predicted)" in text and "predicted, not measured" in text
    browser.load((verdicts_report / "gate-reference-0.2.0-weekly_only.html").as_uri())
    assert "not applicable" in browser.evaluate("document.body.innerText")


def test_a_wide_grid_scrolls_with_the_case_column_fixed(verdicts_report: Path, browser: Tab) -> None:
    browser.load((verdicts_report / "index.html").as_uri())
    box = browser.evaluate(
        """(() => { const s = document.querySelector('.scroll'); const c = s.querySelector('tbody th.case');
            const before = c.getBoundingClientRect().left; s.scrollLeft = s.scrollWidth;
            const after = c.getBoundingClientRect().left;
            const last = [...s.querySelectorAll('thead th.version')].pop().getBoundingClientRect();
            return {scroll: s.scrollWidth, client: s.clientWidth, page: document.documentElement.scrollWidth,
                    window: window.innerWidth, before, after, scrolled: s.scrollLeft, lastRight: last.right}; })()"""
    )
    assert box["scroll"] > box["client"], box  # wider than its box: it scrolls
    assert box["page"] <= box["window"], box  # ...inside the box: the page does not run off
    assert box["scrolled"] > 0 and abs(box["after"] - box["before"]) < 1, box  # the case column stays
    assert box["lastRight"] <= box["window"], box  # the last version came into view
    browser.screenshot(ARTIFACTS / "m21-index-scrolled.png")


def test_runtime_page_shows_gates_groups_repeats_and_no_raw_keys(verdicts_report: Path, browser: Tab) -> None:
    page = browser.load((verdicts_report / "runtime-reference-0.2.0.html").as_uri())
    assert page.errors == [], page.errors
    text = browser.evaluate("document.body.innerText")
    assert "Gate verdicts:" in text and "pre_merge NO-GO" in text and "weekly_only N/A" in text
    section = browser.evaluate("[...document.querySelectorAll('section.cell')]"
                               ".find(s => s.querySelector('h3').innerText.startsWith('aggregated')).innerText")
    assert "3 attempts, same failure" in section, section
    blocks = browser.evaluate("[...document.querySelectorAll('section.cell')].find(s => s.querySelector('h3')"
                              ".innerText.startsWith('aggregated')).querySelectorAll('div.attempt').length")
    assert blocks == 1, "one failure block, not three"
    assert "The same failure also in: attempt" in section
    for raw in ("cpu_s.", "rss_bytes", "gpu_bytes"):
        assert raw not in text, raw
    assert "CPU time: " in text and "memory (RSS): " in text


def test_compare_and_gate_pages_read_clean(verdicts_report: Path, browser: Tab) -> None:
    page = browser.load((verdicts_report / "compare-reference_0.1.0-vs-reference_0.2.0.html").as_uri())
    assert page.errors == [], page.errors
    text = browser.evaluate("document.body.innerText")
    assert "`" not in text
    browser.load((verdicts_report / "gate-reference-0.2.0-release.html").as_uri())
    text = browser.evaluate("document.body.innerText")
    assert "Rules of this policy" in text and "max_slowdown" in text and "0.2 (20 %)" in text


@pytest.mark.parametrize(
    ("name", "page"),
    [("index", "index.html"), ("runtime", "runtime-reference-0.2.0.html"),
     ("compare", "compare-reference_0.1.0-vs-reference_0.2.0.html"),
     ("gate", "gate-reference-0.3.0-pre_merge.html"), ("gate-release", "gate-reference-0.2.0-release.html")],
)  # fmt: skip
def test_screenshots(verdicts_report: Path, browser: Tab, name: str, page: str) -> None:
    load = browser.load((verdicts_report / page).as_uri())
    assert load.errors == [], load.errors
    shot = browser.screenshot(ARTIFACTS / f"m21-{name}.png", full_page=True)
    assert len(shot) > 10_000
