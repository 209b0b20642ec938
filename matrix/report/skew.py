"""The version-skew grid of a case: each (frontend, prefill, decode) cell's latest finished attempt and its
outcome class (`matrix.skew_outcome`), for `matrix skew CASE` and the report's N x N page."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload

from matrix.cells import ROLES
from matrix.db.models import Case, CellRun, Runtime
from matrix.errors import ConfigError
from matrix.outcome import FINISHED_STATUSES, standing_attempt
from matrix.skew_outcome import (
    SKEW_CLASSES,
    PairClass,
    SkewVerdict,
    classify,
    grid_lines,
    logged_refusal,
    refused_unexplained,
    role_options_text,
)
from matrix.versions import parse_version


@dataclass(frozen=True)
class SkewEntry:
    cell: str
    roles: dict[str, str]  # every role's version, the row's runtime for those the skew did not name
    verdict: SkewVerdict
    status: str
    uid: str
    campaign_id: int
    # Every finished attempt's status, oldest first (the exports' pass rates); the latest decides the class.
    statuses: tuple[str, ...] = ()
    # Earlier attempts of the pair whose class differs from this one's (`class in campaign N (uid): reason`):
    # a transient (an engine's handshake timeout under load) or a flaky pair shows here, never hidden.
    disagreed: tuple[str, ...] = ()

    @property
    def skewed(self) -> bool:
        return len(set(self.roles.values())) > 1

    def as_dict(self) -> dict[str, Any]:
        return {"cell": self.cell, **self.roles, **self.verdict.as_dict(), "status": self.status, "uid": self.uid,
                "campaign": self.campaign_id, "attempts": len(self.statuses),
                "disagreed": list(self.disagreed)}  # fmt: skip

    @property
    def label(self) -> str:
        """The class as a grid cell shows it: marked `*` when an earlier attempt disagreed."""
        return f"{self.verdict.cls}*" if self.disagreed else self.verdict.cls


@dataclass(frozen=True)
class SkewGrid:
    case: str
    backend: str
    versions: tuple[str, ...]
    entries: tuple[SkewEntry, ...]
    # The case's launch options per role when they differ (`launch.role_launch`, e.g. block sizes): a skew of
    # options on one release, whose 1 x 1 grid says nothing without them.
    role_launch: dict[str, dict[str, Any]] = field(default_factory=dict)

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

    @property
    def counts(self) -> list[tuple[str, int]]:
        """(class, cells) of every class present, in SKEW_CLASSES order: the page's summary line."""
        found = [e.verdict.cls for e in self.entries]
        return [(cls, found.count(cls)) for cls in SKEW_CLASSES if cls in found]

    def as_dict(self) -> dict[str, Any]:
        return {"case": self.case, "backend": self.backend, "versions": list(self.versions),
                **({"role_launch": self.role_launch} if self.role_launch else {}),
                "cells": [e.as_dict() for e in self.entries]}  # fmt: skip

    @property
    def role_options(self) -> str:
        """`prefill block_size=64; decode block_size=32`: each role's own launch options, or ''."""
        return role_options_text(self.role_launch)


def load_skew_grid(session: Session, case_name: str, campaign_id: int | None = None) -> SkewGrid:
    """Every skew (and diagonal) cell of `case_name` with the attempt that stands for it (of `campaign_id`,
    when given; `outcome.standing_attempt`: the newest pass or failure, a later skip or interruption never
    replaces it), classified."""
    case = session.scalar(select(Case).where(Case.name == case_name))
    if case is None:
        raise ConfigError(f"unknown case {case_name!r}; see `matrix cases list`")
    rows = session.scalars(
        select(CellRun)
        .options(joinedload(CellRun.runtime).joinedload(Runtime.backend))
        .where(CellRun.case_id == case.id, CellRun.status.in_(FINISHED_STATUSES))
        .where(*([CellRun.campaign_id == campaign_id] if campaign_id is not None else []))
        .order_by(CellRun.id)
    ).all()
    by_key: dict[str, list[CellRun]] = {}
    for row in rows:
        by_key.setdefault(row.cell_key, []).append(row)
    statuses = {key: [row.status for row in found] for key, found in by_key.items()}
    # The attempt that stands for the pair, as everywhere else: a later skip or interruption says nothing.
    latest = {key: standing_attempt(found) for key, found in by_key.items()}
    entries = []
    for key, row in ((k, r) for k, r in latest.items() if r is not None):
        roles = {role: (row.roles or {}).get(role, row.runtime.version) for role in ROLES}
        verdict = _verdict(row)
        others = ((other, _verdict(other)) for other in by_key[key] if other.id != row.id)
        disagreed = tuple(
            f"{other_verdict.cls} in campaign {other.campaign_id} ({other.uid}): {_first(other_verdict.reason)}"
            for other, other_verdict in others
            if other_verdict.cls not in (verdict.cls, "not-run")
        )  # fmt: skip
        entries.append(SkewEntry(key, roles, verdict, row.status, row.uid, row.campaign_id, tuple(statuses[key]),
                                 disagreed))  # fmt: skip
    versions = sorted({v for e in entries for v in e.roles.values()}, key=parse_version)
    entries.sort(key=lambda e: tuple(parse_version(e.roles[r]) for r in ROLES))
    return SkewGrid(case.name, case.backend.name, tuple(versions), tuple(entries), _role_launch(case))


def _role_launch(case: Case) -> dict[str, dict[str, Any]]:
    options = (case.launch or {}).get("role_launch") or {}
    return {str(role): dict(values) for role, values in options.items() if isinstance(values, dict) and values}


def _verdict(row: CellRun) -> SkewVerdict:
    verdict = classify(row.status, row.failure_kind, row.message, row.checks or [], row.exit_codes or {})
    said = logged_refusal(row.log_dir) if refused_unexplained(verdict, row.checks or []) else ""
    if said:  # an attempt recorded before the runner kept the engines' own words: read them where they lie
        message = f"{row.message}\n{said}"
        verdict = classify(row.status, row.failure_kind, message, row.checks or [], row.exit_codes or {})
    return verdict


def _first(text: str, limit: int = 300) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:limit]


def grid_text(grid: SkewGrid) -> list[str]:
    """The grid as plain lines (`skew_outcome.grid_lines`)."""
    title = f"{grid.case} ({grid.backend})" + (f", {grid.role_options}" if grid.role_options else "")
    pairs = [PairClass(e.cell, e.roles, e.verdict, e.disagreed) for e in grid.entries]
    return grid_lines(title, grid.versions, pairs)


def skew_page(case: str) -> str:
    from matrix.report.links import slug

    return f"skew-{slug(case)}.html"


def skew_cases(session: Session) -> list[str]:
    """The cases with at least one skew attempt (roles_key set), and the cases that skew their roles' launch
    options (`launch.role_launch`: block sizes) with a finished attempt: each gets an N x N page."""
    stmt = select(Case.name).join(CellRun, CellRun.case_id == Case.id).where(CellRun.roles_key != "").distinct()
    names = set(session.scalars(stmt))
    # Few cases skew their launch options: those are found first, then asked for a finished attempt each (one
    # query over every attempt's status was a tenth of a report refresh at 10^5 attempts).
    for case in session.scalars(select(Case)):
        if case.name in names or not _role_launch(case):
            continue
        finished = select(CellRun.id).where(CellRun.case_id == case.id, CellRun.status.in_(FINISHED_STATUSES)).limit(1)
        if session.execute(finished).first() is not None:
            names.add(case.name)
    return sorted(names)


def skew_grids(session: Session, cases: Iterable[str], campaign_id: int | None = None) -> list[SkewGrid]:
    """The grids of those of `cases` that have skew attempts (of `campaign_id`, when given), for the exports."""
    wanted = set(cases)
    grids = [load_skew_grid(session, name, campaign_id) for name in skew_cases(session) if name in wanted]
    return [grid for grid in grids if any(entry.skewed for entry in grid.entries)]
