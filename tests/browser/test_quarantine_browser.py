"""[M30] items 3 and 6 in a real Chromium, over a report of real reference runs.

* The gate page lists the muted cells (owner, until, how each entered, its evidence, what it muted) apart from
  the blocking reasons; the quarantine page holds every entry and exit with its reason; the evidence page
  shows, per policy, the share of required cells with fresh evidence and each cell's latest evidence.
* Hostile text in owners, reasons and waiver owners stays text: no element, no script, shown as typed.

Screenshots of the gate, quarantine and evidence pages go to tests/browser/artifacts/.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from tests.helpers import toggled_cells as toggled
from tests.helpers.browser import Tab
from tests.helpers.cli import Matrix

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
OWNER = "<script>window.pwned = 1</script> & \"kv\" 'team'"
WAIVER_OWNER = '<img src=x onerror="window.pwned = 2">'
ENDED_REASON = "</td></tr><b onmouseover=alert(3)>fixed</b>"

REST = """
[[case]]
name = "ref_never"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]

[[waiver]]
case = "ref_broken"
runtime_spec = "==0.1.0"
reason = "expired long ago: it excuses nothing, and shows its owner"
expires = "2020-01-01"
owner = {owner}

[[gate]]
name = "q_gate"
expression = "gpu_0"
"""


def _sync(m: Matrix, *, broken: bool) -> None:
    toggled.sync(m, toggled.case("ref_q", broken=broken), toggled.case("ref_broken", broken=True),
                 REST.format(owner=_toml(WAIVER_OWNER)))  # fmt: skip


def _toml(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.fixture(scope="module")
def quarantine_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("quarantine")
    m = Matrix(home=home, db_path=home / "matrix.db")
    _sync(m, broken=False)
    first = m.subprocess("run", "--case", "ref_q", "--case", "ref_broken", "--no-report", "-q", timeout=120)
    assert first.returncode == 1, first.stdout + first.stderr
    _sync(m, broken=True)
    second = m.subprocess("run", "--case", "ref_q", "--auto-quarantine", "--no-report", "-q", timeout=120)
    assert second.returncode == 1 and "entered (automatic" in second.stdout, second.stdout + second.stderr
    until = (dt.datetime.now(dt.UTC).date() + dt.timedelta(days=30)).isoformat()
    for args in (
        ("quarantine", "ref_broken", "--owner", "ops", "--until", until, "--reason", "muted while triaged"),
        ("unquarantine", "ref_broken", "--reason", ENDED_REASON),
        ("quarantine", "ref_broken", "--runtime", "reference=0.1.0", "--owner", OWNER, "--until", until,
         "--reason", "<i>issue</i> 42"),
    ):  # fmt: skip
        result = m(*args)
        assert result.exit_code == 0, result.output
    out = home / "report"
    written = m.subprocess("report", "--out", str(out))
    assert written.returncode == 0, written.stderr
    return out


def _clean_dom(browser: Tab) -> None:
    """No element came from catalog or command-line text, and no script ran."""
    found = browser.evaluate(
        "({scripts: document.querySelectorAll('script').length, "
        "imgs: document.querySelectorAll('img').length, "
        "bold: document.querySelectorAll('main b, body b').length, pwned: window.pwned || 0})"
    )
    assert found == {"scripts": 0, "imgs": 0, "bold": 0, "pwned": 0}, found


def test_the_gate_page_lists_muted_cells_apart_and_owners_stay_text(quarantine_report: Path, browser: Tab) -> None:
    page = browser.load((quarantine_report / "gate-reference-0.1.0-q_gate.html").as_uri())
    assert page.errors == [], page.errors
    _clean_dom(browser)
    text = browser.evaluate("document.body.innerText")
    assert "Muted cells (quarantined" in text
    rows = browser.evaluate(
        "[...document.querySelectorAll('table.muted-cells tbody tr')].map(r => "
        "[...r.querySelectorAll('td')].map(td => td.innerText))"
    )
    by_case = {row[0]: row for row in rows}
    assert set(by_case) == {"ref_q", "ref_broken"}, rows
    assert by_case["ref_broken"][2] == OWNER and by_case["ref_broken"][4] == "manual"
    assert by_case["ref_broken"][6] == "<i>issue</i> 42"
    assert by_case["ref_q"][2] == "unowned" and by_case["ref_q"][4] == "automatic"
    assert "3 clean runs" in by_case["ref_q"][3] and "failed: failed (validation): usage_object" in by_case["ref_q"][7]
    assert len(by_case["ref_q"][5].split(", ")) == 2  # the pass and the failure
    # Nothing blocks but the cell that never ran: INCOMPLETE, with both failures listed as muted, not blocking.
    reasons = browser.evaluate("[...document.querySelectorAll('table.reasons tbody tr')].map(r => r.innerText)")
    assert sum("[muted]" in r for r in reasons) == 2 and text.startswith("Release gate") is False
    assert "INCOMPLETE" in text
    assert f"expired: waiver ==0.1.0 until 2020-01-01 (owner {WAIVER_OWNER})" in text
    blocking = browser.evaluate("[...document.querySelectorAll('table.reasons tr.blocking')].map(r => r.innerText)")
    assert len(blocking) == 1 and "ref_never" in blocking[0], blocking
    browser.screenshot(ARTIFACTS / "m30-gate-muted.png", full_page=True)


def test_the_quarantine_page_keeps_every_entry_and_exit(quarantine_report: Path, browser: Tab) -> None:
    index = browser.load((quarantine_report / "index.html").as_uri())
    assert index.errors == [], index.errors
    assert "Muted cells: 2 in force, 1 ended." in browser.evaluate("document.body.innerText")
    page = browser.load((quarantine_report / "quarantine.html").as_uri())
    assert page.errors == [], page.errors
    _clean_dom(browser)
    in_force = browser.evaluate("[...document.querySelectorAll('table.quarantine tbody tr')].map(r => r.innerText)")
    ended = browser.evaluate(
        "[...document.querySelectorAll('table.quarantine-ended tbody tr td')].map(t => t.innerText)"
    )
    assert len(in_force) == 2 and any(OWNER in row for row in in_force), in_force
    assert ended[:2] == ["ref_broken@every runtime", "ops"] and ended[4:6] == ["manual", ENDED_REASON], ended
    browser.screenshot(ARTIFACTS / "m30-quarantine.png", full_page=True)


def test_the_evidence_page_shows_the_fresh_share_and_each_cells_latest(quarantine_report: Path, browser: Tab) -> None:
    page = browser.load((quarantine_report / "evidence.html").as_uri())
    assert page.errors == [], page.errors
    text = browser.evaluate("document.querySelector('p.coverage').innerText")
    assert text == "2 of 3 required cells (67 %) have evidence newer than 5 day(s); 1 never ran.", text
    rows = browser.evaluate(
        "[...document.querySelectorAll('table.evidence tbody tr')].map(r => "
        "[...r.querySelectorAll('td')].map(td => td.innerText))"
    )
    assert rows[0][:3] == ["reference-0.1.0", "ref_never", "never run"] and rows[0][5] == "no", rows  # first
    fresh = {row[1]: row for row in rows[1:]}
    assert fresh["ref_q"][2].startswith("FAIL ") and fresh["ref_q"][5] == "yes"
    assert fresh["ref_broken"][2].startswith("FAIL ") and fresh["ref_broken"][4].endswith("days")
    width = browser.evaluate("document.querySelector('.bar div').style.width")
    assert width == "66.7%", width
    browser.screenshot(ARTIFACTS / "m30-evidence.png", full_page=True)


def test_the_episodes_page_lists_the_open_episodes_with_their_evidence(
    quarantine_report: Path, browser: Tab
) -> None:
    index = browser.load((quarantine_report / "index.html").as_uri())
    assert index.errors == [], index.errors
    assert "Episodes: 2 open, 0 closed." in browser.evaluate("document.body.innerText")
    page = browser.load((quarantine_report / "episodes.html").as_uri())
    assert page.errors == [], page.errors
    _clean_dom(browser)
    rows = browser.evaluate(
        "[...document.querySelectorAll('table.episodes-open tbody tr')].map(r => "
        "[...r.querySelectorAll('td')].map(td => td.innerText))"
    )
    by_cell = {row[0].removeprefix("OPEN ").strip(): row for row in rows}
    assert set(by_cell) == {"ref_q @ reference-0.1.0", "ref_broken @ reference-0.1.0"}, rows
    # ref_q passed in campaign 1 and failed in campaign 2; ref_broken failed in campaign 1, never having passed.
    q, broken = by_cell["ref_q @ reference-0.1.0"], by_cell["ref_broken @ reference-0.1.0"]
    assert q[1:4] == ["validation", "usage_object", "1"] and q[5].startswith("campaign 2 ") and q[7].startswith(
        "campaign 1 ")  # fmt: skip
    assert broken[1:4] == ["validation", "usage_object", "1"] and broken[5].startswith("campaign 1 ")
    assert broken[7] == "never passed before"
    links = browser.evaluate("[...document.querySelectorAll('table.episodes-open a')].map(a => a.getAttribute('href'))")
    assert set(links) == {"campaign-1.html", "campaign-2.html"}, links
    browser.screenshot(ARTIFACTS / "m30-episodes.png", full_page=True)
