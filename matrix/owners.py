"""Who owns a running row and whether that runner is still alive.

Shared by the scheduler's claims (the last runner out, stale-row recovery) and by `matrix runs` (the status a
reader should see), so that listing campaigns needs nothing from the scheduler.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Iterable

import psutil
from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Campaign, CellRun

# A running row whose heartbeat is older than this belongs to a runner that is gone.
STALE_AFTER_S = 60.0


def owner_alive(host: str, pid: int | None) -> bool | None:
    """True/False on this host; None when the owner is on another host (only the heartbeat can tell)."""
    if host != socket.gethostname():
        return None
    return pid is not None and psutil.pid_exists(pid) and pid != os.getpid()


def owner_gone(row: CellRun, now: dt.datetime) -> bool:
    """Whether the runner of a running row is gone: its pid on this host, its heartbeat elsewhere."""
    alive = owner_alive(row.owner_host, row.owner_pid)
    heartbeat = row.heartbeat_at
    if heartbeat is not None and heartbeat.tzinfo is None:  # SQLite hands back naive UTC datetimes
        heartbeat = heartbeat.replace(tzinfo=now.tzinfo)
    stale = heartbeat is None or (now - heartbeat).total_seconds() > STALE_AFTER_S
    return alive is False or (alive is None and stale)


def orphaned_running(session: Session, now: dt.datetime, campaign_ids: Iterable[int] | None = None) -> set[int]:
    """Ids of `running` rows whose runner is gone: readers show them `interrupted` (the next `matrix run`
    records that; reading changes nothing)."""
    stmt = select(CellRun).where(CellRun.status == "running")
    if campaign_ids is not None:
        stmt = stmt.where(CellRun.campaign_id.in_(sorted(set(campaign_ids))))
    return {row.id for row in session.scalars(stmt) if owner_gone(row, now)}


def shown_campaign_status(session: Session, campaign: Campaign, now: dt.datetime) -> str:
    """The campaign's status as a reader should see it: a `running` campaign whose runners are all gone is
    `interrupted` (the next `matrix run` records that; listing changes nothing)."""
    if campaign.status != "running":
        return campaign.status
    running = list(
        session.scalars(select(CellRun).where(CellRun.campaign_id == campaign.id, CellRun.status == "running"))
    )
    if any(not owner_gone(row, now) for row in running):
        return "running"  # a live runner (the owner, or one that joined) still runs a cell
    alive = owner_alive(campaign.host, campaign.owner_pid)
    # Its owner's pid is gone on this host, or on another host every running row's heartbeat is stale.
    return "interrupted" if alive is False or (alive is None and running) else "running"
