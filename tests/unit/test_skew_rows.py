"""Skew cells in the database: one row per (cell, attempt) with each role's runtime, claimed and resumed as
cells of their own, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from matrix.campaign import RunOptions, _cells_with_latest, _selected_cells
from matrix.db.engine import transaction
from matrix.db.models import Campaign, CellRun
from matrix.plan import Selection
from matrix.schedule.claims import claim_attempt

pytestmark = pytest.mark.all_databases

GRID = Selection(cases=("dynamo_mocker_disaggregated",), skew=True)


def _campaign(factory, selection: Selection = GRID) -> int:  # type: ignore[no-untyped-def]
    with transaction(factory) as session:
        campaign_id, _ = _selected_cells(session, RunOptions(selection=selection), lambda _: None)
        return campaign_id


def test_a_grid_has_a_row_per_pair_with_each_roles_version(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = _campaign(factory)
    with factory() as session:
        rows = session.scalars(select(CellRun).where(CellRun.campaign_id == campaign_id)).all()
        assert len(rows) == 9
        by_key = {r.cell_key: r for r in rows}
        skew = by_key["dynamo_mocker_disaggregated@dynamo[prefill=1.4.2,decode=1.6.1]"]
        assert skew.roles == {"prefill": "1.4.2", "decode": "1.6.1"} and skew.runtime.version == "1.6.1"
        assert skew.roles_key == "prefill=1.4.2,decode=1.6.1"
        diagonal = by_key["dynamo_mocker_disaggregated@dynamo-1.6.1"]
        assert (diagonal.roles, diagonal.roles_key) == ({}, "")


def test_pairs_sharing_decodes_runtime_are_claimed_apart(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = _campaign(factory)
    with factory() as session:
        cells = [c for c, _, _ in _cells_with_latest(session, session.get_one(Campaign, campaign_id))]
    # Three cells share decode's runtime 1.6.1 (and so the row's runtime_id): each is its own claim.
    same_decode = [c for c in cells if c.runtime.version == "1.6.1"]
    assert len(same_decode) == 3
    claims = [claim_attempt(factory, campaign_id, c, 1, lambda uid: f"logs/{uid}") for c in same_decode]
    assert all(claims) and len({claim[1] for claim in claims if claim}) == 3
    assert all(claim_attempt(factory, campaign_id, c, 1, lambda uid: "x") is None for c in same_decode)
    # A retry of one pair inserts its own row next to the others' first attempts.
    assert claim_attempt(factory, campaign_id, same_decode[0], 2, lambda uid: f"logs/{uid}") is not None


def test_resume_plans_the_stored_skew_again(factory) -> None:  # type: ignore[no-untyped-def]
    campaign_id = _campaign(factory, Selection(cases=("dynamo_mocker_disaggregated",), prefill_runtime="dynamo=1.4.2",
                                               decode_runtime="dynamo=1.5.1"))  # fmt: skip
    with factory() as session:
        campaign = session.get_one(Campaign, campaign_id)
        assert campaign.selection["prefill_runtime"] == "dynamo=1.4.2"
        cells = _cells_with_latest(session, campaign)
    assert [(c.key, attempt, status) for c, attempt, status in cells] == [
        ("dynamo_mocker_disaggregated@dynamo[prefill=1.4.2,decode=1.5.1]", 1, "pending")]
