"""Evidence age ([M30] item 6): for each required cell of a gate policy, the date and age of its latest
evidence, and the share of required cells whose evidence is newer than N days: a coverage view (as
vllm-dashboard's parity page and llm-d's five-day window are).

A policy's required cells are, for every enabled runtime that is not retired nor a variant, the cases the gate
would require of it (`gate.required_cases`). A cell's evidence is its latest informative attempt (a pass, or a
failure of the cell's own; skips and interruptions prove nothing) of the cell whose roles all run the runtime.
A cell with none has no date and is never fresh.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from matrix.db.models import CellRun, GatePolicy
from matrix.errors import MatrixError
from matrix.outcome import CELL_FAULT_STATUSES, PASSED
from matrix.report.data import load_cases, load_runtimes
from matrix.report.gate import Policy, is_variant, load_policy, required_cases
from matrix.text import clean

__all__ = ["DEFAULT_DAYS", "EvidenceCell", "PolicyEvidence", "evidence_age"]

# llm-d's window: evidence older than five days no longer speaks for today's build.
DEFAULT_DAYS = 5


@dataclass(frozen=True)
class EvidenceCell:
    runtime: str
    case: str
    status: str | None  # the latest informative attempt's status; None: never run
    uid: str | None
    finished_at: dt.datetime | None
    age_days: float | None
    fresh: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime, "case": self.case, "status": self.status, "attempt": self.uid,
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "age_days": round(self.age_days, 3) if self.age_days is not None else None, "fresh": self.fresh,
        }  # fmt: skip


@dataclass(frozen=True)
class PolicyEvidence:
    policy: str
    expression: str
    days: int
    cells: tuple[EvidenceCell, ...]
    # Why the gate refuses the policy (an unknown rule...): it then has no cells ("" when it is sound).
    error: str = ""

    @property
    def fresh(self) -> int:
        return sum(1 for c in self.cells if c.fresh)

    @property
    def share(self) -> float | None:
        """Fresh cells over required cells; None when the policy requires nothing."""
        return self.fresh / len(self.cells) if self.cells else None

    @property
    def never_run(self) -> int:
        return sum(1 for c in self.cells if c.status is None)

    def summary(self) -> str:
        if self.error:
            return f"policy {self.policy}: not judged: {self.error}"
        if not self.cells:
            return f"policy {self.policy}: requires no cell of an enabled runtime"
        share = self.share or 0.0
        return (f"policy {self.policy}: {self.fresh} of {len(self.cells)} required cells ({100 * share:.0f} %) have "
                f"evidence newer than {self.days} day(s); {self.never_run} never ran")  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "expression": self.expression, "days": self.days,
                "required": len(self.cells), "fresh": self.fresh, "share": self.share, "never_run": self.never_run,
                "cells": [c.as_dict() for c in self.cells], "error": self.error or None}  # fmt: skip


def evidence_age(
    session: Session, days: int = DEFAULT_DAYS, now: dt.datetime | None = None, policies: Iterable[str] | None = None
) -> list[PolicyEvidence]:
    """Per policy (every one of the catalog, or those named), its required cells' evidence, oldest first.
    A named policy the gate refuses is a `ConfigError`; among every policy of the catalog, one the gate refuses
    (an unknown rule) is listed with the reason and no cells, as the report's gate badges show it."""
    now = now or dt.datetime.now(dt.UTC)
    if policies is not None:
        chosen: list[Policy | tuple[str, str]] = [load_policy(session, name) for name in policies]
    else:
        chosen = []
        for name in session.scalars(
            select(GatePolicy.name).where(GatePolicy.retired.is_(False)).order_by(GatePolicy.name)
        ):
            try:
                chosen.append(load_policy(session, name))
            except MatrixError as exc:
                chosen.append((name, clean(str(exc))))
    every = load_runtimes(session)
    runtimes = [r for r in every if r.enabled and not r.retired and not is_variant(every, r)]
    cases = load_cases(session)
    latest = _latest(session)
    found = []
    for policy in chosen:
        if isinstance(policy, tuple):
            found.append(PolicyEvidence(policy[0], "", days, (), policy[1]))
            continue
        cells = []
        for runtime in runtimes:
            required, _ = required_cases(cases, runtime, policy)
            for case in required:
                uid, status, finished = latest.get((case.id, runtime.id), (None, None, None))
                age = (now - _aware(finished)).total_seconds() / 86400 if finished is not None else None
                fresh = age is not None and age <= days
                cells.append(EvidenceCell(runtime.label, case.name, status, uid,
                                          _aware(finished) if finished else None, age, fresh))  # fmt: skip
        # Never run first, then the oldest: what needs running tops the list.
        cells.sort(key=lambda c: (c.age_days is not None, -(c.age_days or 0.0), c.runtime, c.case))
        found.append(PolicyEvidence(policy.name, policy.expression, days, tuple(cells)))
    return found


def _latest(session: Session) -> dict[tuple[int, int], tuple[str, str, dt.datetime | None]]:
    """(case id, runtime id) -> (uid, status, finished_at) of its latest informative attempt (roles all one runtime)."""
    newest = (
        select(func.max(CellRun.id))
        .where(CellRun.status.in_((PASSED, *CELL_FAULT_STATUSES)), CellRun.roles_key == "")
        .group_by(CellRun.case_id, CellRun.runtime_id)
    )  # fmt: skip
    rows = session.execute(
        select(CellRun.case_id, CellRun.runtime_id, CellRun.uid, CellRun.status, CellRun.finished_at).where(
            CellRun.id.in_(newest)
        )
    )
    return {(case_id, runtime_id): (uid, status, finished) for case_id, runtime_id, uid, status, finished in rows}


def _aware(moment: dt.datetime) -> dt.datetime:
    """SQLite gives naive datetimes, stored as UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
