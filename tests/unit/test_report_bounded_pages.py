"""A runtime page stays bounded however long a cell's history: the newest attempts whole, older ones counted."""

from __future__ import annotations

from pathlib import Path

from matrix.report import links
from matrix.report.views import LISTED_FAILURES, SHOWN_ATTEMPTS
from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, read, sync

LOG_LINE = "engine says hello from a long history\n"


def test_only_the_newest_attempts_are_shown_whole(matrix: Matrix, tmp_path: Path) -> None:
    sync(matrix)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "prefill.log").write_text(LOG_LINE * 50)
    history = 60
    with db(matrix) as s:
        for i in range(history):
            c = campaign(s)
            if i == 0:  # the oldest pass decides: every newer attempt was skipped
                status = "passed"
            elif i % 2 == 0 and i < 50:
                status = "failed"
            else:
                status = "skipped"
            extra = {"failure_kind": "validation", "message": f"bad answer {i}"} if status == "failed" else {}
            if status == "skipped":  # each its own reason, so that none is folded into another
                extra = {"message": "no host " + "x" * i}
            attempt(s, c, "vllm_agg_check", "vllm=0.29.0", status, log_dir=str(logs), **extra)
    out = tmp_path / "report"
    assert matrix("report", "--out", str(out)).exit_code == 0
    page = read(out / links.runtime_page("vllm", "0.29.0"))
    # The newest attempts whole and the failure that stands for the cell (the newest failure, i = 48),
    # each with its log tail; nothing older inlined.
    assert page.count("prefill.log: last") == SHOWN_ATTEMPTS + 1
    assert f"{history - SHOWN_ATTEMPTS - 1} older attempt(s), not shown whole" in page
    failures = 24  # i = 2, 4, ... 48; the newest of them stands and is shown whole
    assert page.count("bad answer 48") == 1  # shown whole: its message
    listed = page.split('<ul class="older-failures">', 1)[1].split("</ul>", 1)[0]
    assert listed.count("<li>") == LISTED_FAILURES  # one line each, the newest first
    assert listed.index("campaign 47<") < listed.index("campaign 45<")
    assert f"and {failures - 1 - LISTED_FAILURES} older failure(s)" in page
    assert "PFFFFFFFFFFFFFFFFFFFFFFF" in page  # the trend: the pass, then the failures (skips are no samples)
