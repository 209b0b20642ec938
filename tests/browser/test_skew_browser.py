"""[M20] The report's version-skew page in a real browser: a release manager must tell every class apart at a
glance (legend, one colour per class) and reach a pair's reason with one click."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.browser import Tab
from tests.helpers.cli import Matrix
from tests.helpers.skew import NIXL, grid_campaign

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CLASSES = ("works", "clean-reject", "hang", "error-answer", "healthy-but-wrong", "crash", "exposed", "not-run")


def test_the_skew_page_has_a_legend_distinct_colours_and_the_reason_one_click_away(
    seeded: Matrix, tmp_path: Path, browser: Tab
) -> None:
    grid_campaign(seeded)  # the diagonal works, one clean-reject, one hang, four pairs not run yet
    assert seeded("report", "--out", str(tmp_path)).exit_code == 0
    page = tmp_path / "skew-dynamo_mocker_disaggregated.html"
    load = browser.load(page.as_uri())
    assert load.errors == [] and load.requests == [page.as_uri()]
    colours = browser.evaluate(
        "Object.fromEntries([...document.querySelectorAll('ul.skew-legend .swatch')]"
        ".map(s => [s.textContent, getComputedStyle(s).backgroundColor]))"
    )
    assert sorted(colours) == sorted(CLASSES)
    assert len(set(colours.values())) == len(CLASSES), f"two classes share a colour: {colours}"
    # A grid cell has its legend's colour, and the diagonal is outlined.
    hang = browser.page.locator("td.skew-hang").first
    assert hang.evaluate("e => getComputedStyle(e).backgroundColor") == colours["hang"]
    assert browser.page.locator("td.skew.diagonal").count() == 3
    browser.screenshot(ARTIFACTS / "skew-page.png", full_page=True)
    # One click: the hang cell's link lands on its reason row, highlighted and on screen.
    hang.locator("a").click()
    browser.page.wait_for_timeout(200)
    target = browser.evaluate("document.querySelector(':target')?.textContent ?? ''")
    assert "prefill=1.6.1,decode=1.4.2" in target and "hang" in target and "no answer in 60 s" in target
    assert browser.evaluate("getComputedStyle(document.querySelector(':target td')).backgroundColor") == (
        "rgb(255, 248, 197)"
    )
    assert browser.evaluate("(() => { const r = document.querySelector(':target').getBoundingClientRect(); "
                            "return r.top >= 0 && r.bottom <= innerHeight; })()")  # fmt: skip
    clean = browser.page.locator("td.skew-clean-reject a").first
    assert NIXL in (clean.get_attribute("title") or "")  # the reason on hover too
