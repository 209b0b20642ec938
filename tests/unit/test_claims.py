"""Claims on a real database (SQLite and PostgreSQL): pending rows, one owner per attempt under real
concurrent processes (in `tests/e2e/test_claims_processes.py`), and the last runner out setting the
campaign's status."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import select

from matrix.db.models import CellRun
from matrix.schedule.claims import claim_attempt
from tests.helpers.claims import new_campaign, reference_cells

pytestmark = pytest.mark.all_databases


def test_a_new_campaign_records_a_pending_row_per_cell(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = new_campaign(factory)
    with factory() as session:
        rows = session.scalars(select(CellRun).where(CellRun.campaign_id == campaign_id)).all()
        assert sorted(r.cell_key for r in rows) == sorted(c.key for c in reference_cells(factory))
        assert {(r.status, r.attempt, r.owner_pid, r.started_at) for r in rows} == {("pending", 1, None, None)}
        assert len({r.uid for r in rows}) == len(rows)


def test_an_attempt_is_claimed_once_and_a_retry_gets_its_own_row(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = new_campaign(factory)
    cell = reference_cells(factory)[0]
    first = claim_attempt(factory, campaign_id, cell, 1, lambda uid: f"logs/{uid}")
    assert first is not None
    assert claim_attempt(factory, campaign_id, cell, 1, lambda uid: f"logs/{uid}") is None
    retry = claim_attempt(factory, campaign_id, cell, 2, lambda uid: f"logs/{uid}")
    assert retry is not None and retry[1] != first[1]
    assert claim_attempt(factory, campaign_id, cell, 2, lambda uid: f"logs/{uid}") is None
    with factory() as session:
        row = session.get_one(CellRun, first[1])
        assert (row.status, row.owner_pid, row.uid, row.log_dir) == (
            "running",
            os.getpid(),
            first[0],
            f"logs/{first[0]}",
        )


