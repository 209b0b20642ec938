"""The version-skew grid of a case: each (frontend, prefill, decode) cell's latest finished attempt and its
outcome class (`matrix.skew_outcome`), for `matrix skew CASE` and the report's N x N page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload

from matrix.cells import ROLES
from matrix.db.models import Case, CellRun, Runtime
from matrix.errors import ConfigError
from matrix.outcome import FINISHED_STATUSES
from matrix.skew_outcome import SkewVerdict, classify, logged_refusal, refused_unexplained
from matrix.versions import parse_version


@dataclass(frozen=True)
class SkewEntry:
    cell: str
    roles: dict[str, str]  # every role's version, the row's runtime for those the skew did not name
    verdict: SkewVerdict
    status: str
    uid: str
    campaign_id: int

    def as_dict(self) -> dict[str, Any]:
        return {"cell": self.cell, **self.roles, **self.verdict.as_dict(), "status": self.status, "uid": self.uid,
                "campaign": self.campaign_id}  # fmt: skip


@dataclass(frozen=True)
class SkewGrid:
    case: str
    backend: str
    versions: tuple[str, ...]
    entries: tuple[SkewEntry, ...]

    def at(self, prefill: str, decode: str, frontend: str | None = None) -> SkewEntry | None:
        for entry in self.entries:
            if (entry.roles["prefill"], entry.roles["decode"]) == (prefill, decode) and (
                frontend is None or entry.roles["frontend"] == frontend
            ):
                return entry
        return None

    @property
    def frontends(self) -> tuple[str, ...]:
        """The frontend versions with a cell whose frontend differs from decode's (a 3-axis grid), else ()."""
        if all(e.roles["frontend"] == e.roles["decode"] for e in self.entries):
            return ()
        return tuple(v for v in self.versions if any(e.roles["frontend"] == v for e in self.entries))

    def as_dict(self) -> dict[str, Any]:
        return {"case": self.case, "backend": self.backend, "versions": list(self.versions),
                "cells": [e.as_dict() for e in self.entries]}  # fmt: skip


def load_skew_grid(session: Session, case_name: str) -> SkewGrid:
    """Every skew (and diagonal) cell of `case_name` with its latest finished attempt, classified."""
    case = session.scalar(select(Case).where(Case.name == case_name))
    if case is None:
        raise ConfigError(f"unknown case {case_name!r}; see `matrix cases list`")
    rows = session.scalars(
        select(CellRun)
        .options(joinedload(CellRun.runtime).joinedload(Runtime.backend))
        .where(CellRun.case_id == case.id, CellRun.status.in_(FINISHED_STATUSES))
        .order_by(CellRun.id)
    ).all()
    latest: dict[str, CellRun] = {}
    for row in rows:
        latest[row.cell_key] = row
    entries = []
    for key, row in latest.items():
        roles = {role: (row.roles or {}).get(role, row.runtime.version) for role in ROLES}
        verdict = classify(row.status, row.failure_kind, row.message, row.checks or [], row.exit_codes or {})
        said = logged_refusal(row.log_dir) if refused_unexplained(verdict, row.checks or []) else ""
        if said:  # an attempt recorded before the runner kept the engines' own words: read them where they lie
            message = f"{row.message}\n{said}"
            verdict = classify(row.status, row.failure_kind, message, row.checks or [], row.exit_codes or {})
        entries.append(SkewEntry(key, roles, verdict, row.status, row.uid, row.campaign_id))
    versions = sorted({v for e in entries for v in e.roles.values()}, key=parse_version)
    entries.sort(key=lambda e: tuple(parse_version(e.roles[r]) for r in ROLES))
    return SkewGrid(case.name, case.backend.name, tuple(versions), tuple(entries))


def skew_page(case: str) -> str:
    from matrix.report.links import slug

    return f"skew-{slug(case)}.html"


def skew_cases(session: Session) -> list[str]:
    """The cases with at least one skew attempt (roles_key set): each gets an N x N page."""
    stmt = select(Case.name).join(CellRun, CellRun.case_id == Case.id).where(CellRun.roles_key != "").distinct()
    return sorted(session.scalars(stmt))
