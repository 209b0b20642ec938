"""Tabular views of the catalog for `matrix <kind> list`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from matrix.db.models import Backend, Case, CaseFix, CaseMarker, Fix, GatePolicy, Marker, Runtime
from matrix.versions import parse_version

Listing = tuple[tuple[str, ...], list[tuple[Any, ...]]]


def list_backends(session: Session, *, include_retired: bool = False) -> Listing:
    stmt = select(Backend).order_by(Backend.name)
    if not include_retired:
        stmt = stmt.where(Backend.retired.is_(False))
    rows = [
        (b.name, len([r for r in b.runtimes if not r.retired]), b.description, b.retired)
        for b in session.scalars(stmt)
    ]
    return ("name", "runtimes", "description", "retired"), rows


def list_runtimes(session: Session, *, include_retired: bool = False) -> Listing:
    stmt = select(Runtime).options(selectinload(Runtime.backend), selectinload(Runtime.components))
    if not include_retired:
        stmt = stmt.where(Runtime.retired.is_(False))
    runtimes = sorted(session.scalars(stmt), key=lambda r: (r.backend.name, parse_version(r.version)))
    rows = [
        (
            r.backend.name, r.version, r.tag, r.channel, r.provider.get("kind", ""),
            " ".join(f"{c.name}={c.version}" for c in r.components), r.enabled, r.source, r.retired,
        )
        for r in runtimes
    ]  # fmt: skip
    return (
        "backend",
        "version",
        "tag",
        "channel",
        "provider",
        "components",
        "enabled",
        "source",
        "retired",
    ), rows


def list_markers(session: Session, *, include_retired: bool = False) -> Listing:
    stmt = select(Marker).order_by(Marker.kind, Marker.name)
    if not include_retired:
        stmt = stmt.where(Marker.retired.is_(False))
    rows = [(m.name, m.kind, m.parametrised, m.description, m.retired) for m in session.scalars(stmt)]
    return ("name", "kind", "parametrised", "description", "retired"), rows


def list_cases(session: Session, *, include_retired: bool = False) -> Listing:
    stmt = (
        select(Case)
        .options(
            selectinload(Case.backend),
            selectinload(Case.markers).selectinload(CaseMarker.marker),
            selectinload(Case.fixes).selectinload(CaseFix.fix),
        )
        .order_by(Case.name)
    )
    if not include_retired:
        stmt = stmt.where(Case.retired.is_(False))
    rows = [
        (
            c.name, c.backend.name, c.arm, c.model, " ".join(m.text for m in c.markers),
            c.version_constraint, " ".join(f.fix.key for f in c.fixes), c.enabled, c.retired,
        )
        for c in session.scalars(stmt)
    ]  # fmt: skip
    return (
        "name",
        "backend",
        "arm",
        "model",
        "markers",
        "constraint",
        "requires",
        "enabled",
        "retired",
    ), rows


def list_fixes(session: Session, *, include_retired: bool = False) -> Listing:
    stmt = select(Fix).order_by(Fix.key)
    if not include_retired:
        stmt = stmt.where(Fix.retired.is_(False))
    rows = [
        (f.key, f.component, ", ".join(f.fixed_in), f.link, f.description, f.retired)
        for f in session.scalars(stmt)
    ]
    return ("key", "component", "fixed_in", "link", "description", "retired"), rows


def list_gates(session: Session, *, include_retired: bool = False) -> Listing:
    stmt = select(GatePolicy).order_by(GatePolicy.name)
    if not include_retired:
        stmt = stmt.where(GatePolicy.retired.is_(False))
    rows = [(g.name, g.expression, g.rules, g.description, g.retired) for g in session.scalars(stmt)]
    return ("name", "expression", "rules", "description", "retired"), rows


LISTINGS: dict[str, Callable[..., Listing]] = {
    "backends": list_backends,
    "runtimes": list_runtimes,
    "markers": list_markers,
    "cases": list_cases,
    "fixes": list_fixes,
    "gates": list_gates,
}

__all__: Sequence[str] = ["LISTINGS"]
