"""How runners sharing one campaign divide its cells: pending rows, claims, and the last runner out.

A new campaign gets a `pending` row for every planned cell (attempt 1) in the transaction that creates
it. A runner claims an attempt by turning its pending row into `running` in one short transaction. On
PostgreSQL the row is picked with `SELECT ... FOR UPDATE SKIP LOCKED`, so a runner never waits on a row
that another runner is claiming at that instant; the UPDATE is also conditional on `status = 'pending'`,
which is what makes the claim atomic on SQLite (it has no row locks, ignores FOR UPDATE and serialises
writers instead). Retries (attempt n+1) and cells of campaigns recorded before pending rows existed
have no pending row: the runner inserts the attempt's row, and the unique (campaign, case, runtime,
attempt) key makes a racing insert fail.

Every runner of a campaign (its owner, joiners, resumers) calls `leave_campaign` at its end; only the
last one out, when no live runner still has a cell running, sets the campaign's final status.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterable
from typing import Any, cast

from sqlalchemy import CursorResult, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from matrix.cells import Cell, roles_key
from matrix.db.engine import transaction
from matrix.db.models import Campaign, Case, CellRun, Runtime, utcnow
from matrix.outcome import highest_attempts
from matrix.owners import owner_gone

# Latest-attempt statuses that leave a campaign unfinished (resumable).
UNFINISHED_STATUSES = frozenset({"pending", "running", "interrupted"})


def new_uid() -> str:
    """A MATRIX_CELL_ID: short enough for process listings, random enough never to repeat."""
    return f"c{uuid.uuid4().hex[:12]}"


# A cell's identity in a campaign's rows: (case id, runtime id, roles key); '' for a diagonal cell.
CellIds = tuple[int, int, str]


def cell_ids(cell: Cell) -> CellIds:
    if cell.case.id is None or cell.runtime.id is None:
        raise RuntimeError(f"cell {cell.key} was not planned from the database")
    return cell.case.id, cell.runtime.id, roles_key(cell.role_versions)


def new_cell_row(session: Session, campaign: Campaign, cell: Cell, uid: str, attempt: int) -> CellRun:
    """The `running` row of an attempt that had no pending row (a retry, or a campaign from before them)."""
    case_id, runtime_id, key = cell_ids(cell)
    row = CellRun(
        uid=uid,
        roles=cell.role_versions,
        roles_key=key,
        campaign=campaign,
        case=session.get_one(Case, case_id),
        runtime=session.get_one(Runtime, runtime_id),
        attempt=attempt,
        status="running",
        started_at=utcnow(),
        heartbeat_at=utcnow(),
        owner_host=socket.gethostname(),
        owner_pid=os.getpid(),
        checks=[],
    )
    session.add(row)
    return row


def add_pending_rows(session: Session, campaign_id: int, cells: Iterable[Cell], repeat: int = 1) -> None:
    """`pending` rows for attempts 1..`repeat` of every cell, in the caller's transaction (the one creating
    the campaign). Each repeat is an attempt like any other: claimed, run and recorded on its own."""
    values: list[dict[str, Any]] = []
    for cell in cells:
        case_id, runtime_id, key = cell_ids(cell)
        values.extend(
            {"uid": new_uid(), "campaign_id": campaign_id, "case_id": case_id, "runtime_id": runtime_id,
             "roles": cell.role_versions, "roles_key": key, "attempt": attempt, "status": "pending", "checks": []}
            for attempt in range(1, repeat + 1)
        )  # fmt: skip
    if values:
        session.execute(insert(CellRun), values)


def claim_attempt(
    factory: sessionmaker[Session], campaign_id: int, cell: Cell, attempt: int, log_dir: Callable[[str], str]
) -> tuple[str, int] | None:
    """Make this runner the owner of `attempt` of `cell`: (uid, row id), or None when another runner has it.

    `log_dir` maps the attempt's uid to the directory its logs go to.
    """
    case_id, runtime_id, key = cell_ids(cell)
    same_cell = (CellRun.campaign_id == campaign_id, CellRun.case_id == case_id, CellRun.runtime_id == runtime_id,
                 CellRun.roles_key == key)  # fmt: skip
    now = utcnow()
    with transaction(factory) as session:
        pending = session.execute(
            select(CellRun.id, CellRun.uid)
            .where(*same_cell, CellRun.attempt == attempt, CellRun.status == "pending")
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if pending is not None:
            row_id, uid = pending
            result = cast(
                CursorResult[Any],
                session.connection().execute(
                    update(CellRun)
                    .where(CellRun.id == row_id, CellRun.status == "pending")
                    .values(
                        status="running", started_at=now, heartbeat_at=now, owner_host=socket.gethostname(),
                        owner_pid=os.getpid(), log_dir=log_dir(uid),
                    )
                ),
            )  # fmt: skip
            return (uid, row_id) if result.rowcount == 1 else None
    uid = new_uid()
    try:
        with transaction(factory) as session:
            # A row of this attempt or a later one, in any state (a pending row locked by a runner that is
            # claiming it right now included), means the attempt is someone else's.
            taken = session.scalar(select(CellRun.id).where(*same_cell, CellRun.attempt >= attempt).limit(1))
            if taken is not None:
                return None
            campaign = session.get_one(Campaign, campaign_id)
            row = new_cell_row(session, campaign, cell, uid, attempt)
            row.log_dir = log_dir(uid)
            session.flush()
            return uid, row.id
    except IntegrityError:
        return None


def pending_attempts(session: Session, campaign_id: int) -> dict[CellIds, list[int]]:
    """`cell_ids` -> the attempt numbers still `pending` in a campaign (never started)."""
    found: dict[CellIds, list[int]] = {}
    rows = session.execute(
        select(CellRun.case_id, CellRun.runtime_id, CellRun.roles_key, CellRun.attempt)
        .where(CellRun.campaign_id == campaign_id, CellRun.status == "pending")
        .order_by(CellRun.attempt)
    )
    for case_id, runtime_id, key, attempt in rows:
        found.setdefault((case_id, runtime_id, key), []).append(attempt)
    return found


def latest_statuses(session: Session, campaign_id: int) -> dict[CellIds, tuple[int, str]]:
    """`cell_ids` -> (its highest attempt, that one's status) within a campaign (`highest_attempts`)."""
    rows = session.execute(
        select(CellRun.case_id, CellRun.runtime_id, CellRun.roles_key, CellRun.attempt, CellRun.status)
        .where(CellRun.campaign_id == campaign_id)
        .order_by(CellRun.attempt)
    )
    return highest_attempts(((case_id, runtime_id, key), attempt, status)
                            for case_id, runtime_id, key, attempt, status in rows)  # fmt: skip


def leave_campaign(factory: sessionmaker[Session], campaign_id: int, *, interrupted: bool) -> str:
    """This runner is done with the campaign; returns the campaign's status afterwards.

    While another live runner still has a cell running, the campaign stays `running` and that runner
    becomes its owner (so recovery on its host judges the campaign by a live pid). The last runner out
    sets `finished`, or `interrupted` when it was stopped or cells are left to resume.
    """
    me = (socket.gethostname(), os.getpid())
    now = utcnow()
    with transaction(factory) as session:
        # The row lock serialises runners leaving at the same moment (a no-op on SQLite, which
        # serialises writers anyway); each one's outcomes are committed before it gets here.
        campaign = session.scalars(select(Campaign).where(Campaign.id == campaign_id).with_for_update()).one()
        running = session.scalars(
            select(CellRun).where(CellRun.campaign_id == campaign_id, CellRun.status == "running")
        )
        others = [row for row in running if (row.owner_host, row.owner_pid) != me and not owner_gone(row, now)]
        if others:
            campaign.status = "running"
            campaign.host, campaign.owner_pid = others[0].owner_host, others[0].owner_pid
            return campaign.status
        unfinished = any(status in UNFINISHED_STATUSES for _, status in latest_statuses(session, campaign_id).values())
        campaign.status = "interrupted" if interrupted or unfinished else "finished"
        campaign.finished_at = now
        return campaign.status
