"""Who owns a running row and whether that runner is still alive.

Shared by the scheduler's claims (the last runner out, stale-row recovery) and by `matrix runs` (the status a
reader should see), so that listing campaigns needs nothing from the scheduler.
"""

from __future__ import annotations

import datetime as dt
import os
import socket

import psutil

from matrix.db.models import CellRun

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
