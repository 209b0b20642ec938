"""One owner per attempt under real concurrent runner processes (SQLite and PostgreSQL)."""

from __future__ import annotations

import multiprocessing
import random
from collections import Counter

import pytest
from sqlalchemy import select

from matrix.db.engine import create_db_engine, session_factory
from matrix.db.models import CellRun
from matrix.schedule.claims import claim_attempt
from tests.unit.claims_db import _cells, _new_campaign, catalog_factory

pytestmark = pytest.mark.all_databases


@pytest.fixture
def factory(db_url: str):  # type: ignore[no-untyped-def]
    yield from catalog_factory(db_url)


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
