"""Read attempts back from the database: one cell for `matrix show`, the campaigns for `matrix campaigns`
(the writer is `matrix/results.py`)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Campaign, Case, CellRun, utcnow
from matrix.errors import ConfigError
from matrix.outcome import STORED_COLUMNS, highest_attempts
from matrix.owners import orphaned_running, shown_campaign_status


def find_cell(session: Session, text: str) -> CellRun:
    """By MATRIX_CELL_ID, by row id, or the cell's key `CASE@BACKEND-VERSION` / `CASE@BACKEND[prefill=A,...]`
    (its latest attempt: a skew pair's rows share decode's runtime, so the whole key must match)."""
    row = session.scalar(select(CellRun).where(CellRun.uid == text))
    if row is None and text.isdigit():
        row = session.get(CellRun, int(text))
    if row is None and "@" in text:
        case_name, _, _ = text.partition("@")
        # Ids first, rows one by one: the newest match is near the top, and a case's whole history of
        # full rows (logs and all) would be read only to skip it.
        candidates = session.scalars(
            select(CellRun.id).join(Case).where(Case.name == case_name).order_by(CellRun.id.desc())
        )
        rows = (session.get(CellRun, rid) for rid in candidates)
        row = next((r for r in rows if r is not None and r.cell_key == text), None)
    if row is None:
        raise ConfigError(
            f"no cell {text!r}: give a cell id, a row id, or CASE@BACKEND-VERSION (see `matrix run` output)"
        )
    return row


def _iso(value: dt.datetime | None) -> str | None:
    """UTC with its zone and every digit the database kept (SQLite hands back naive UTC datetimes)."""
    if value is None:
        return None
    return (value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)).isoformat()


def _pass_rate(row: CellRun) -> dict[str, Any] | None:
    """The pass rate of the row's case on its runtime over every attempt in the database (Wilson 95 %)."""
    from sqlalchemy.orm import object_session

    from matrix.report.stats import pass_rate

    session = object_session(row)
    if session is None:
        return None
    statuses = session.scalars(
        select(CellRun.status)
        .where(CellRun.case_id == row.case_id, CellRun.runtime_id == row.runtime_id, CellRun.roles_key == row.roles_key)
        .order_by(CellRun.id)
    )
    return pass_rate(list(statuses)).as_dict()


def describe_cell(row: CellRun) -> dict[str, Any]:
    from pathlib import Path

    log_dir = Path(row.log_dir) if row.log_dir else None
    logs = {p.stem: str(p) for p in sorted(log_dir.glob("*.log"))} if log_dir and log_dir.is_dir() else {}
    # Every stored column of the outcome (`STORED_COLUMNS`), between the attempt's identity and where it ran.
    return {
        "cell": row.cell_key,
        "id": row.uid,
        "campaign": row.campaign_id,
        "attempt": row.attempt,
        "started_at": _iso(row.started_at),
        "finished_at": _iso(row.finished_at),
        **{name: getattr(row, name) for name in STORED_COLUMNS},
        "pass_rate": _pass_rate(row),
        "log_dir": row.log_dir,
        "logs": logs,
    }


def shown_status(session: Session, campaign: Campaign, now: dt.datetime) -> str:
    """The campaign's status as a reader should see it (`matrix.owners.shown_campaign_status`)."""
    return shown_campaign_status(session, campaign, now)


def campaign_rows(session: Session, limit: int) -> list[dict[str, Any]]:
    """The latest `limit` campaigns, newest first, with their cells counted by latest-attempt status.

    What a user needs to pick a campaign for `--resume`, `--join` or `--rerun-failed`.
    """
    campaigns = list(session.scalars(select(Campaign).order_by(Campaign.id.desc()).limit(limit)))
    # A cell is (case, runtime, roles key): a skew cell's pairs share decode's runtime id.
    latest: dict[int, dict[tuple[int, int, str], tuple[int, str]]] = {c.id: {} for c in campaigns}
    if campaigns:
        rows = session.execute(
            select(CellRun.campaign_id, CellRun.case_id, CellRun.runtime_id, CellRun.roles_key, CellRun.attempt,
                   CellRun.status)
            .where(CellRun.campaign_id.in_(latest))
            .order_by(CellRun.attempt)
        )  # fmt: skip
        by_cell = highest_attempts(((c, case, rt, rk), attempt, status) for c, case, rt, rk, attempt, status in rows)
        for (campaign_id, case_id, runtime_id, roles), state in by_cell.items():
            latest[campaign_id][(case_id, runtime_id, roles)] = state
    out = []
    now = utcnow()
    # A running row whose runner is gone counts as interrupted, as the campaign's status says.
    orphans = orphaned_running(session, now, latest)
    gone = {
        (c, case, rt, rk, attempt)
        for c, case, rt, rk, attempt in session.execute(
            select(CellRun.campaign_id, CellRun.case_id, CellRun.runtime_id, CellRun.roles_key, CellRun.attempt).where(
                CellRun.id.in_(sorted(orphans))
            )
        )
    } if orphans else set()  # fmt: skip
    for campaign in campaigns:
        counts: dict[str, int] = {}
        for (case_id, runtime_id, roles), (attempt, status) in latest[campaign.id].items():
            shown = "interrupted" if (campaign.id, case_id, runtime_id, roles, attempt) in gone else status
            counts[shown] = counts.get(shown, 0) + 1
        out.append(
            {
                "id": campaign.id,
                "status": shown_status(session, campaign, now),
                "started_at": _iso(campaign.started_at),
                "finished_at": _iso(campaign.finished_at),
                "executor": campaign.executor,
                "host": campaign.host,
                "key": str(campaign.selection.get("campaign_key", "")),
                "cells": len(campaign.selection.get("cells", ())),
                "outcomes": dict(sorted(counts.items())),
            }
        )
    return out
