"""Quarantined (muted) cells as the gate and the report read them ([M30] item 3).

A quarantine mutes a cell: its attempts still run and are recorded, and the gate lists the findings it would
have blocked on as *muted* instead of blocking on them. What mutes is written by `matrix.quarantine` (manual
entry and exit, automatic entry on flake evidence, automatic exit after clean runs); this module only reads.
A quarantine is in force from its entry until its exit is recorded or its `until` day (UTC) has passed,
whichever comes first: the gate never waits for a run to record an expiry.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from matrix.db.models import Quarantine, Runtime
from matrix.text import clean

__all__ = ["MUTABLE_KINDS", "QuarantineView", "load_quarantines"]

# The gate findings a quarantine mutes: those that say the cell misbehaved. Never a missing fix (the catalog
# knows the runtime is broken for the case), missing evidence (a muted cell still has to run), nor a version-skew
# pair's finding (the pair is a cell of its own, which a quarantine of the diagonal cell does not cover).
MUTABLE_KINDS = frozenset({
    "failed", "regression", "flaky", "low-pass-rate", "inconclusive", "exposure", "slowdown", "slowdown-untested",
})  # fmt: skip


@dataclass(frozen=True)
class QuarantineView:
    id: int
    case: str
    case_id: int
    runtime_id: int | None
    runtime: str  # "reference-0.1.0", or "every runtime"
    roles_key: str
    owner: str
    reason: str
    until: dt.date | None
    entry: str
    evidence: tuple[str, ...]
    clean_runs: int | None
    entered_at: dt.datetime
    exited_at: dt.datetime | None
    exit: str | None
    exit_reason: str
    exit_evidence: tuple[str, ...]

    def active(self, today: dt.date) -> bool:
        return self.exited_at is None and (self.until is None or today <= self.until)

    def covers(self, case_id: int, runtime_id: int, roles_key: str = "") -> bool:
        return (self.case_id == case_id and self.runtime_id in (None, runtime_id)
                and self.roles_key == roles_key)  # fmt: skip

    @property
    def cell(self) -> str:
        return f"{self.case}@{self.runtime}" + (f"[{self.roles_key}]" if self.roles_key else "")

    @property
    def ends(self) -> str:
        """When it ends by itself: "2026-12-31", "3 clean runs", both joined by "or", or "" (by hand only)."""
        ends = [self.until.isoformat()] if self.until else []
        ends += [f"{self.clean_runs} clean runs"] if self.clean_runs else []
        return " or ".join(ends)

    def describe(self) -> str:
        """One line: how it entered, who owns it, until when, and why."""
        until = f", until {self.ends}" if self.ends else ""
        return f"quarantined ({self.entry}, owner {clean(self.owner)}{until}): {clean(self.reason)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "case": self.case, "runtime": self.runtime, "roles": self.roles_key or None,
            "owner": self.owner, "reason": self.reason, "until": self.until.isoformat() if self.until else None,
            "entry": self.entry, "evidence": list(self.evidence), "clean_runs": self.clean_runs,
            "entered_at": _iso(self.entered_at), "exited_at": _iso(self.exited_at), "exit": self.exit,
            "exit_reason": self.exit_reason, "exit_evidence": list(self.exit_evidence),
        }  # fmt: skip


def load_quarantines(
    session: Session, case_ids: Iterable[int] | None = None, *, current_only: bool = False
) -> list[QuarantineView]:
    """Quarantines, oldest entry first; `current_only`: those whose exit is not recorded (an expired one
    included: `QuarantineView.active` tells)."""
    stmt = select(Quarantine).options(
        selectinload(Quarantine.case), selectinload(Quarantine.runtime).selectinload(Runtime.backend)
    )
    if case_ids is not None:
        stmt = stmt.where(Quarantine.case_id.in_(sorted(set(case_ids))))
    if current_only:
        stmt = stmt.where(Quarantine.exited_at.is_(None))
    return [view(row) for row in session.scalars(stmt.order_by(Quarantine.id))]


def view(row: Quarantine) -> QuarantineView:
    runtime = f"{row.runtime.backend.name}-{row.runtime.version}" if row.runtime is not None else "every runtime"
    return QuarantineView(
        row.id, row.case.name, row.case_id, row.runtime_id, runtime, row.roles_key, row.owner, row.reason, row.until,
        row.entry, tuple(str(u) for u in row.evidence or ()), row.clean_runs, _aware(row.entered_at),
        _aware(row.exited_at) if row.exited_at else None, row.exit, row.exit_reason,
        tuple(str(u) for u in row.exit_evidence or ()),
    )  # fmt: skip


def _aware(moment: dt.datetime) -> dt.datetime:
    """SQLite gives naive datetimes, stored as UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


def _iso(moment: dt.datetime | None) -> str | None:
    return _aware(moment).isoformat() if moment is not None else None
