"""Claims on a real database (SQLite and PostgreSQL): pending rows, one owner per attempt under real
concurrent processes, and the last runner out setting the campaign's status."""

from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
from collections import Counter

import pytest
from sqlalchemy import select

from matrix.campaign import RunOptions, _selected_cells
from matrix.catalog.load import default_catalog_files, load_catalog
from matrix.catalog.sync import sync_catalog
from matrix.db.engine import create_db_engine, session_factory, transaction
from matrix.db.migrate import ensure_schema
from matrix.db.models import Campaign, CellRun
from matrix.plan import Cell, Selection, plan_from_db
from matrix.schedule.claims import claim_attempt, leave_campaign

pytestmark = pytest.mark.all_databases

REFERENCE = Selection(backends=("reference",))


def _cells(factory) -> list[Cell]:  # type: ignore[no-untyped-def]
    with factory() as session:
        return list(plan_from_db(session, REFERENCE).cells)


def _new_campaign(factory) -> int:  # type: ignore[no-untyped-def]
    with transaction(factory) as session:
        campaign_id, _ = _selected_cells(session, RunOptions(selection=REFERENCE), lambda _: None)
        return campaign_id


@pytest.fixture
def factory(db_url: str):  # type: ignore[no-untyped-def]
    engine = create_db_engine(db_url)
    ensure_schema(engine)
    factory = session_factory(engine)
    with transaction(factory) as session:
        sync_catalog(session, load_catalog(default_catalog_files()))
    yield factory
    engine.dispose()


def test_a_new_campaign_records_a_pending_row_per_cell(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = _new_campaign(factory)
    with factory() as session:
        rows = session.scalars(select(CellRun).where(CellRun.campaign_id == campaign_id)).all()
        assert sorted(r.cell_key for r in rows) == sorted(c.key for c in _cells(factory))
        assert {(r.status, r.attempt, r.owner_pid, r.started_at) for r in rows} == {("pending", 1, None, None)}
        assert len({r.uid for r in rows}) == len(rows)


def test_an_attempt_is_claimed_once_and_a_retry_gets_its_own_row(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = _new_campaign(factory)
    cell = _cells(factory)[0]
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


def _claim_everything(url: str, campaign_ids: list[int], seed: int) -> list[tuple[int, str]]:
    """One runner process: try to claim every cell of every campaign, in its own random order."""
    engine = create_db_engine(url)
    factory = session_factory(engine)
    work = [(campaign_id, cell) for campaign_id in campaign_ids for cell in _cells(factory)]
    random.Random(seed).shuffle(work)
    won = []
    for campaign_id, cell in work:
        if claim_attempt(factory, campaign_id, cell, 1, lambda uid: uid) is not None:
            won.append((campaign_id, cell.key))
    engine.dispose()
    return won


def test_concurrent_runner_processes_claim_each_cell_exactly_once(factory, db_url: str) -> None:  # type: ignore[no-untyped-def]
    campaign_ids = [_new_campaign(factory) for _ in range(15)]
    cells = len(_cells(factory))
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(_claim_everything, [(db_url, campaign_ids, seed) for seed in range(4)])
    claims = Counter(claim for won in results for claim in won)
    assert len(claims) == len(campaign_ids) * cells  # every cell claimed...
    assert set(claims.values()) == {1}  # ...by exactly one runner
    with factory() as session:
        statuses = session.scalars(select(CellRun.status).where(CellRun.campaign_id.in_(campaign_ids))).all()
    assert set(statuses) == {"running"} and len(statuses) == len(claims)


def test_only_the_last_runner_out_finishes_the_campaign(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = _new_campaign(factory)
    mine, theirs = _cells(factory)[:2]
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
