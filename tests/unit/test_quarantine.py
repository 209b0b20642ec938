"""[M30] item 3, the rules of `matrix.quarantine` on attempts written straight into the database: a quarantine
whose `until` day has passed stops muting at once and its exit is recorded by the next update; an automatic
entry takes its owner from a waiver in force that names one; evidence a quarantine was released on never
enters the cell again; a waiver's owner shows on the gate."""

from __future__ import annotations

import datetime as dt
import json

from matrix.db.models import Quarantine
from matrix.quarantine import AutoRule, update_after_run
from matrix.report.gate import evaluate_gate
from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync

GATE = """
[[gate]]
name = "agg"
expression = "e2e and pre_merge"
"""
WAIVER = """
[[waiver]]
case = "vllm_agg_check"
runtime_spec = "==0.29.0"
reason = "known flaky on 0.29.0"
owner = "serving-team <oncall@example.org>"
"""
NOW = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5)  # after the attempts written now


def test_a_quarantine_past_its_day_stops_muting_and_its_exit_is_recorded(matrix: Matrix) -> None:
    sync(matrix, GATE)
    with db(matrix) as s:
        attempt(s, campaign(s), "vllm_agg_check", "vllm=0.30.0", "failed")
    today = dt.datetime.now(dt.UTC).date()
    entered = matrix("quarantine", "vllm_agg_check", "--owner", "me", "--until", today.isoformat(), "--reason", "r")
    assert entered.exit_code == 0, entered.output
    with db(matrix) as s:
        muted = evaluate_gate(s, "vllm", "0.30.0", "agg", today=today)
        later = evaluate_gate(s, "vllm", "0.30.0", "agg", today=today + dt.timedelta(days=1))
        assert muted.verdict != "NO-GO" and [c.case.name for c in muted.muted] == ["vllm_agg_check"]
        assert later.muted == [] and any(r.kind == "failed" and r.blocking for r in later.reasons)
        tomorrow = dt.datetime.combine(today + dt.timedelta(days=1), dt.time(1), tzinfo=dt.UTC)
        lines = update_after_run(s, [], None, tomorrow)
    assert lines == [f"quarantine: vllm_agg_check@every runtime exited: until {today.isoformat()} passed"]
    (row,) = json.loads(matrix("quarantines", "--all", "--json").output)["quarantines"]
    assert (row["exit"], row["exit_reason"], row["in_force"]) == ("expired", f"until {today.isoformat()} passed",
                                                                  False)  # fmt: skip


def test_automatic_entry_takes_the_waiver_owner_and_never_reuses_released_evidence(matrix: Matrix) -> None:
    sync(matrix, GATE, WAIVER)
    rule = AutoRule(window_days=7, clean_runs=1)
    with db(matrix) as s:
        passed = attempt(s, campaign(s), "vllm_agg_check", "vllm=0.29.0", "passed")
        second = campaign(s)
        failed = attempt(s, second, "vllm_agg_check", "vllm=0.29.0", "failed")
        (line,) = update_after_run(s, [second.id], rule, NOW)
        assert "entered (automatic, owner serving-team <oncall@example.org>)" in line
        row = s.query(Quarantine).one()
        assert row.evidence == [passed.uid, failed.uid] and row.clean_runs == 1
        # The case on 0.30.0 (no waiver there) that passed and failed: unowned.
        third = campaign(s)
        attempt(s, third, "vllm_agg_check", "vllm=0.30.0", "passed")
        attempt(s, third, "vllm_agg_check", "vllm=0.30.0", "failed", attempt_no=2)
        (other,) = update_after_run(s, [third.id], rule, NOW)
        assert "vllm_agg_check@vllm-0.30.0 entered (automatic, owner unowned)" in other
        # One clean run releases the 0.29.0 cell; the old failure, asked about again, does not re-enter it.
        fourth = campaign(s)
        clean = attempt(s, fourth, "vllm_agg_check", "vllm=0.29.0", "passed")
        assert update_after_run(s, [fourth.id], rule, NOW) == [
            f"quarantine: vllm_agg_check@vllm-0.29.0 exited after 1 clean runs ({clean.uid})"
        ]
        assert update_after_run(s, [second.id], rule, NOW) == []
        # Evidence older than the window is none: a new failure whose only pass is 8 days old enters nothing.
        fifth = campaign(s)
        attempt(s, fifth, "vllm_agg_check", "vllm=0.29.0", "failed")
        assert update_after_run(s, [fifth.id], rule, NOW + dt.timedelta(days=8)) == []


def test_a_waivers_owner_shows_on_the_gate(matrix: Matrix) -> None:
    sync(matrix, GATE, WAIVER)
    with db(matrix) as s:
        attempt(s, campaign(s), "vllm_agg_check", "vllm=0.29.0", "failed")
    text = matrix("gate", "vllm", "0.29.0", "--policy", "agg").output
    assert "excused by waiver ==0.29.0 (owner serving-team <oncall@example.org>): known flaky on 0.29.0" in text
