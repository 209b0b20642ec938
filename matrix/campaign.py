"""One `matrix run`: plan, record a campaign, run its cells one after another, write every outcome.

The database is written in short transactions (campaign row, each cell's start, each outcome), so a
crash loses at most the cell in flight, and that one is found and cleaned up by the next run through
its owner and heartbeat (`recover_stale`).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from matrix import __version__
from matrix.db.engine import transaction
from matrix.db.models import FAILED_STATUSES, Campaign, CellRun, utcnow
from matrix.hardware.gpus import inventory
from matrix.hardware.ports import PortAllocator
from matrix.interrupts import CellInterrupted, StopSignal
from matrix.launch.supervisor import kill_cell_processes
from matrix.paths import port_registry_path, runs_dir
from matrix.plan import Cell, Selection, plan_from_db
from matrix.results import new_cell_row, record_outcome
from matrix.runner import CellOutcome, HostInfo, run_cell

HEARTBEAT_S = 5.0
# A running row whose heartbeat is older than this belongs to a runner that is gone.
STALE_AFTER_S = 60.0

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 3

Echo = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    selection: Selection
    logs_dir: Path | None = None
    quiet: bool = False


def _git_sha() -> str:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


def _owner_alive(host: str, pid: int | None) -> bool | None:
    """True/False on this host; None when the owner is on another host (only the heartbeat can tell)."""
    if host != socket.gethostname():
        return None
    return pid is not None and psutil.pid_exists(pid) and pid != os.getpid()


def recover_stale(factory: sessionmaker[Session], echo: Echo) -> int:
    """Mark cells of dead runners `interrupted` and kill any process still carrying their cell id."""
    now = utcnow()
    recovered = 0
    with transaction(factory) as session:
        for row in session.scalars(select(CellRun).where(CellRun.status == "running")):
            alive = _owner_alive(row.owner_host, row.owner_pid)
            heartbeat = row.heartbeat_at
            if heartbeat is not None and heartbeat.tzinfo is None:
                heartbeat = heartbeat.replace(tzinfo=now.tzinfo)
            stale = heartbeat is None or (now - heartbeat).total_seconds() > STALE_AFTER_S
            if alive is False or (alive is None and stale):
                killed = kill_cell_processes(row.uid) if alive is False else []
                row.status = "interrupted"
                row.failure_kind = "infra"
                row.message = f"runner {row.owner_host}:{row.owner_pid} died while this cell ran" + (
                    f"; killed {len(killed)} leftover process(es)" if killed else ""
                )
                row.finished_at = now
                recovered += 1
                echo(f"recovered {row.uid} ({row.cell_key}): owner gone, marked interrupted")
        for campaign in session.scalars(select(Campaign).where(Campaign.status == "running")):
            alive = _owner_alive(campaign.host, campaign.owner_pid)
            if alive is False:
                campaign.status = "interrupted"
                campaign.finished_at = campaign.finished_at or now
    return recovered


class _Heartbeat(threading.Thread):
    """Keeps `heartbeat_at` of this runner's running rows fresh, from its own connection."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        super().__init__(name="matrix-heartbeat", daemon=True)
        self._factory = factory
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(HEARTBEAT_S):
            with transaction(self._factory) as session:
                session.execute(
                    update(CellRun)
                    .where(CellRun.status == "running", CellRun.owner_pid == os.getpid())
                    .values(heartbeat_at=utcnow())
                )

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=HEARTBEAT_S)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@+-]", "_", text)


def _summary_line(cell: Cell, row_uid: str, outcome: CellOutcome) -> str:
    label = outcome.status.upper()
    parts = [f"{label:<11} {cell.key} [{row_uid}]"]
    if outcome.status == "passed" and outcome.ready_s is not None and outcome.request_s is not None:
        parts.append(f"ready {outcome.ready_s:.2f}s, request {outcome.request_s * 1000:.0f} ms")
    if outcome.failure_kind:
        parts.append(f"{outcome.failure_kind}: {outcome.message.splitlines()[0] if outcome.message else ''}")
    elif outcome.message:
        parts.append(outcome.message.splitlines()[0])
    if outcome.expected_failure:
        parts.append(f"(expected: {outcome.expected_failure})")
    return " - ".join(parts)


def run_campaign(factory: sessionmaker[Session], options: RunOptions, echo: Echo) -> int:
    recover_stale(factory, echo)
    with transaction(factory) as session:
        plan = plan_from_db(session, options.selection)
        if not plan.cells:
            echo("nothing to run: the selection matches no cells (see `matrix plan --explain`)")
            return EXIT_OK
        campaign = Campaign(
            status="running",
            selection={**options.selection.as_dict(), "cells": [c.key for c in plan.cells]},
            host=socket.gethostname(),
            executor="local",
            git_sha=_git_sha(),
            matrix_version=__version__,
            owner_pid=os.getpid(),
        )
        session.add(campaign)
        session.flush()
        campaign_id = campaign.id
    logs_root = (options.logs_dir or runs_dir()) / f"campaign-{campaign_id}"
    echo(f"campaign {campaign_id}: {len(plan.cells)} cells, logs in {logs_root}")

    allocator = PortAllocator(port_registry_path())
    host = HostInfo(gpu_ids=tuple(str(gpu.index) for gpu in inventory()))
    stop = StopSignal()
    stop.install()
    heartbeat = _Heartbeat(factory)
    heartbeat.start()
    counts: dict[str, int] = {}
    interrupted = False
    started = time.monotonic()
    try:
        for cell in plan.cells:
            if stop.requested:
                interrupted = True
                break
            outcome = _run_one(factory, campaign_id, cell, logs_root, allocator, host, stop, echo)
            if outcome is None:
                interrupted = True
                break
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
    finally:
        heartbeat.stop()
        stop.restore()
        with transaction(factory) as session:
            row = session.get_one(Campaign, campaign_id)
            row.status = "interrupted" if interrupted else "finished"
            row.finished_at = utcnow()
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no cells finished"
    echo(f"campaign {campaign_id} {'interrupted' if interrupted else 'finished'} in "
         f"{time.monotonic() - started:.1f}s: {summary}")  # fmt: skip
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if any(counts.get(s) for s in FAILED_STATUSES) else EXIT_OK


def _run_one(
    factory: sessionmaker[Session],
    campaign_id: int,
    cell: Cell,
    logs_root: Path,
    allocator: PortAllocator,
    host: HostInfo,
    stop: StopSignal,
    echo: Echo,
) -> CellOutcome | None:
    """Run and record one cell; None when the runner was interrupted (the row says `interrupted`)."""
    if cell.case.id is None or cell.runtime.id is None:
        raise RuntimeError(f"cell {cell.key} was not planned from the database")
    uid = f"c{uuid.uuid4().hex[:12]}"
    log_dir = logs_root / f"{_safe_name(cell.key)}-{uid}"
    with transaction(factory) as session:
        campaign = session.get_one(Campaign, campaign_id)
        row = new_cell_row(session, campaign, cell.case.id, cell.runtime.id, uid, attempt=1)
        row.log_dir = str(log_dir)
        session.flush()
        row_id = row.id
    echo(f"{'START':<11} {cell.key} [{uid}]")
    try:
        outcome = run_cell(cell, uid, log_dir, allocator, host, stop)
    except CellInterrupted as exc:
        with transaction(factory) as session:
            row = session.get_one(CellRun, row_id)
            row.status = "interrupted"
            row.failure_kind = "infra"
            row.message = f"runner received {exc}; the pair was torn down"
            row.finished_at = utcnow()
        echo(f"{'INTERRUPTED':<11} {cell.key} [{uid}] - runner received {exc}; pair torn down")
        return None
    with transaction(factory) as session:
        record_outcome(session.get_one(CellRun, row_id), outcome)
    echo(_summary_line(cell, uid, outcome))
    return outcome
