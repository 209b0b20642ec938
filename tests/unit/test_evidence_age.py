"""[M30] item 6: per gate policy, each required cell's latest evidence with its date and age, and the share of
required cells with evidence newer than N days; skips and skew pairs are no evidence of the cell. On attempts
written straight into the database, judged at a later moment."""

from __future__ import annotations

import datetime as dt
import json

from matrix.report.evidence import evidence_age
from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync

GATE = """
[[gate]]
name = "agg"
expression = "e2e and pre_merge"
"""


def test_evidence_ages_and_the_fresh_share(matrix: Matrix) -> None:
    sync(matrix, GATE)
    with db(matrix) as s:
        camp = campaign(s)
        passed = attempt(s, camp, "vllm_agg_check", "vllm=0.29.0", "passed")
        attempt(s, camp, "vllm_agg_check", "vllm=0.29.0", "skipped", attempt_no=2)  # proves nothing
        failed = attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", "failed")
        now = dt.datetime.now(dt.UTC)
        (today,) = evidence_age(s, 5, now)
        (later,) = evidence_age(s, 5, now + dt.timedelta(days=6))
    assert today.policy == "agg" and len(today.cells) >= 2
    cells = {(c.runtime, c.case): c for c in today.cells}
    old, new = cells[("vllm-0.29.0", "vllm_agg_check")], cells[("vllm-0.30.0", "vllm_agg_check")]
    assert (old.status, old.uid, old.fresh) == ("passed", passed.uid, True)
    assert (new.status, new.uid, new.fresh) == ("failed", failed.uid, True)
    assert today.fresh == 2 and today.share == 2 / len(today.cells)
    assert today.never_run == len(today.cells) - 2
    assert today.cells[0].status is None  # never run first
    assert later.fresh == 0 and later.share == 0.0
    aged = {(c.runtime, c.case): c for c in later.cells}[("vllm-0.29.0", "vllm_agg_check")]
    assert aged.age_days is not None and 6.0 <= aged.age_days < 6.1 and not aged.fresh

    shown = json.loads(matrix("evidence", "--policy", "agg", "--days", "5", "--json").output)
    (policy,) = shown["policies"]
    assert (policy["fresh"], policy["required"]) == (2, len(today.cells))
    text = matrix("evidence", "--policy", "agg", "--stale").output  # the fresh cells are left out
    assert f"policy agg: 2 of {len(today.cells)} required cells" in text
    assert "never run" in text and "passed" not in text and "failed" not in text


def test_an_unknown_policy_is_exit_2(matrix: Matrix) -> None:
    sync(matrix, GATE)
    result = matrix("evidence", "--policy", "nope")
    assert result.exit_code == 2 and "unknown gate policy 'nope'" in result.output
