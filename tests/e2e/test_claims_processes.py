"""A campaign shared by runners, one of them a live process, on a real database."""

from __future__ import annotations

import subprocess

import pytest
from sqlalchemy import select

from matrix.db.engine import transaction
from matrix.db.models import Campaign, CellRun
from matrix.schedule.claims import claim_attempt, leave_campaign
from tests.helpers.claims import new_campaign, reference_cells

pytestmark = [pytest.mark.e2e, pytest.mark.all_databases]


def test_only_the_last_runner_out_finishes_the_campaign(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = new_campaign(factory)
    mine, theirs = reference_cells(factory)[:2]
    assert claim_attempt(factory, campaign_id, mine, 1, str) is not None
    assert claim_attempt(factory, campaign_id, theirs, 1, str) is not None
    other_runner = subprocess.Popen(["sleep", "60"])  # a live process standing in for another runner
    try:
        with transaction(factory) as session:
            for row in session.scalars(select(CellRun).where(CellRun.campaign_id == campaign_id)):
                if row.case_id == mine.case.id:
                    row.status = "passed"
                else:
                    row.owner_pid = other_runner.pid
        # Another live runner still has a cell running: the campaign stays running, owned by it.
        assert leave_campaign(factory, campaign_id, interrupted=False) == "running"
        with factory() as session:
            campaign = session.get_one(Campaign, campaign_id)
            assert (campaign.status, campaign.owner_pid, campaign.finished_at) == ("running", other_runner.pid, None)
    finally:
        other_runner.kill()
        other_runner.wait()
    # That runner died with its cell running: the last one out leaves the campaign resumable.
    assert leave_campaign(factory, campaign_id, interrupted=False) == "interrupted"
    with transaction(factory) as session:
        for row in session.scalars(select(CellRun).where(CellRun.campaign_id == campaign_id)):
            row.status = "passed"
    assert leave_campaign(factory, campaign_id, interrupted=False) == "finished"
    assert leave_campaign(factory, campaign_id, interrupted=True) == "interrupted"
