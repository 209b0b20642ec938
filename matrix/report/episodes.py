"""Failure episodes ([M30] item 1): a cell that fails opens an episode, which stays open across repeats,
shards, imports and reruns, and closes only on an observed pass of the same cell.

A cell here is a (case, runtime, role tuple): a skew pair is its own cell. Its finished attempts are read
in the order they were recorded; only pass-rate samples count (`outcome.standing_attempt`'s rule): a pass,
or a failure of the cell's own (`failed`, `error`, `timeout`). A skip, a not-run or an interruption says
nothing about the runtime, so it neither opens nor closes an episode. Each episode keeps its first bad
attempt and the last good one before it (None: the cell never passed before), the attempt that closed it,
how many failures it saw, and the first bad attempt's class (`failure_kind`) and signature (its failed
checks, else its message's first line): what a release manager needs to tell "still broken" from "broken
again, differently".
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Backend, Case, CellRun, Runtime
from matrix.outcome import CELL_FAULT_STATUSES, PASSED

SIGNATURE_CHARS = 160


@dataclass(frozen=True)
class Attempt:
    """What an episode needs of one finished attempt."""

    uid: str
    campaign_id: int
    status: str
    finished_at: dt.datetime | None
    failure_kind: str | None
    signature: str


@dataclass
class Episode:
    """One run of failures of one cell, from its first bad attempt to the pass that closed it (if any)."""

    case: str
    runtime: str  # the runtime's label, with the roles of a skew pair: "vllm-0.30.0[prefill=...]"
    first_bad: Attempt
    last_good: Attempt | None
    failures: int = 1
    last_bad: Attempt | None = None
    closed_by: Attempt | None = None

    @property
    def open(self) -> bool:
        return self.closed_by is None

    def age_s(self, now: dt.datetime) -> float | None:
        """Seconds from the first bad attempt to the close, or to `now` while open."""
        start = self.first_bad.finished_at
        end = self.closed_by.finished_at if self.closed_by is not None else now
        if start is None or end is None:
            return None
        return max(0.0, (_aware(end) - _aware(start)).total_seconds())

    def as_dict(self, now: dt.datetime) -> dict[str, Any]:
        def attempt(a: Attempt | None) -> dict[str, Any] | None:
            if a is None:
                return None
            return {"uid": a.uid, "campaign": a.campaign_id, "status": a.status,
                    "finished_at": _aware(a.finished_at).isoformat() if a.finished_at else None}  # fmt: skip

        return {
            "case": self.case, "runtime": self.runtime, "state": "open" if self.open else "closed",
            "failures": self.failures, "class": self.first_bad.failure_kind, "signature": self.first_bad.signature,
            "first_bad": attempt(self.first_bad), "last_bad": attempt(self.last_bad or self.first_bad),
            "last_good": attempt(self.last_good), "closed_by": attempt(self.closed_by), "age_s": self.age_s(now),
        }  # fmt: skip


def episodes_of(case: str, runtime: str, attempts: Iterable[Attempt]) -> list[Episode]:
    """The episodes of one cell from its attempts in recorded order (see the module docstring)."""
    found: list[Episode] = []
    last_good: Attempt | None = None
    current: Episode | None = None
    for attempt in attempts:
        if attempt.status == PASSED:
            if current is not None:
                current.closed_by = attempt
                current = None
            last_good = attempt
        elif attempt.status in CELL_FAULT_STATUSES:
            if current is None:
                current = Episode(case, runtime, attempt, last_good)
                found.append(current)
            else:
                current.failures += 1
                current.last_bad = attempt
    return found


# Past this many ids the attempts of failing cells are picked in Python, not by an IN list (SQLite's variable limit).
IN_LIST_LIMIT = 900


def load_episodes(session: Session) -> list[Episode]:
    """Every episode in the database, newest first (open ones first of all)."""
    labels = {
        runtime_id: f"{backend}-{version}"
        for runtime_id, backend, version in session.execute(
            select(Runtime.id, Backend.name, Runtime.version).join(Backend, Runtime.backend_id == Backend.id)
        )
    }
    names = {case_id: name for case_id, name in session.execute(select(Case.id, Case.name))}
    # Only a cell that ever failed has episodes: the database finds those cells in one pass, and only their
    # attempts are read whole (over a year of nightlies most cells never fail: 2 of 100 in the benchmark).
    failing = {(case_id, runtime_id, roles_key) for case_id, runtime_id, roles_key in session.execute(
        select(CellRun.case_id, CellRun.runtime_id, CellRun.roles_key).where(CellRun.status.in_(CELL_FAULT_STATUSES))
        .distinct())}  # fmt: skip
    if not failing:
        return []
    stmt = (
        select(CellRun.case_id, CellRun.runtime_id, CellRun.roles_key, CellRun.uid, CellRun.campaign_id,
               CellRun.status, CellRun.finished_at, CellRun.failure_kind)
        .where(CellRun.status.in_((PASSED, *CELL_FAULT_STATUSES)))
        .order_by(CellRun.id)
    )  # fmt: skip
    case_ids, runtime_ids = sorted({c for c, _, _ in failing}), sorted({r for _, r, _ in failing})
    if len(case_ids) + len(runtime_ids) <= IN_LIST_LIMIT:
        stmt = stmt.where(CellRun.case_id.in_(case_ids), CellRun.runtime_id.in_(runtime_ids))
    cells: dict[tuple[int, int, str], list[Attempt]] = {}
    for case_id, runtime_id, roles_key, uid, campaign_id, status, finished_at, kind in session.execute(stmt):
        if (case_id, runtime_id, roles_key) in failing:
            cells.setdefault((case_id, runtime_id, roles_key), []).append(
                Attempt(uid, campaign_id, status, finished_at, kind, "")
            )
    found = []
    for (case_id, runtime_id, roles_key), attempts in cells.items():
        runtime = labels.get(runtime_id, f"runtime {runtime_id}") + (f"[{roles_key}]" if roles_key else "")
        found += episodes_of(names.get(case_id, f"case {case_id}"), runtime, attempts)
    # Only a first bad attempt's signature is shown: reading every attempt's checks and message was most of
    # the cost over a long history, so they are read for those attempts alone.
    signatures = _signatures(session, sorted({e.first_bad.uid for e in found}))
    for episode in found:
        episode.first_bad = replace(episode.first_bad, signature=signatures.get(episode.first_bad.uid, ""))
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    return sorted(found, key=lambda e: (not e.open, -_aware(e.first_bad.finished_at or epoch).timestamp()))


def open_episodes_of(episodes: Iterable[Episode], runtime_label: str, cases: Iterable[str]) -> list[Episode]:
    """The open episodes of `cases` on one runtime (`backend-version`), its skew pairs included: what a gate of
    that runtime names beside its verdict."""
    wanted = set(cases)
    return [e for e in episodes if e.open and e.case in wanted
            and (e.runtime == runtime_label or e.runtime.startswith(runtime_label + "["))]  # fmt: skip


def _signatures(session: Session, uids: list[str], chunk: int = 500) -> dict[str, str]:
    found: dict[str, str] = {}
    for start in range(0, len(uids), chunk):
        stmt = select(CellRun.uid, CellRun.status, CellRun.checks, CellRun.message).where(
            CellRun.uid.in_(uids[start:start + chunk]))  # fmt: skip
        for uid, status, checks, message in session.execute(stmt):
            found[uid] = _signature(status, checks, message)
    return found


def _signature(status: str, checks: Any, message: str) -> str:
    if status == PASSED:
        return ""
    names = sorted({str(c.get("name")) for c in checks or () if isinstance(c, dict) and c.get("name")})
    if names:
        return ", ".join(names)[:SIGNATURE_CHARS]
    first_line = message.strip().splitlines()[0] if message.strip() else status
    return first_line[:SIGNATURE_CHARS]


def _aware(moment: dt.datetime) -> dt.datetime:
    """SQLite gives naive datetimes, stored as UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
