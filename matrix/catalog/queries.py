"""What reads the catalog tables: the tabular views for `matrix <kind> list`, the detached `CaseInfo` and
`RuntimeInfo` of a row, and the catalog view the planner plans from (`plan_from_db`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from matrix.cells import CaseInfo, Cell, RequiredFix, RuntimeInfo, launch_table
from matrix.db.models import (
    Backend,
    Case,
    CaseFix,
    CaseMarker,
    CellRun,
    Fix,
    GatePolicy,
    Marker,
    Runtime,
    RuntimeComponent,
)
from matrix.kv_bound import KvBound
from matrix.markers import parse_marker_use
from matrix.plan import Plan, Selection, make_plan
from matrix.traffic_profile import TRAFFIC_KEY, stored_traffic
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


def case_info(case: Case) -> CaseInfo:
    required = [RequiredFix(cf.fix.key, cf.fix.component, tuple(cf.fix.fixed_in), cf.fix.link) for cf in case.fixes]
    return _case_info(case, case.backend.name, [cm.text for cm in case.markers], required)


def _case_info(case: Any, backend: str, markers: Sequence[str], fixes: Sequence[RequiredFix]) -> CaseInfo:
    """A `CaseInfo` from a case's columns (an ORM `Case` or a row of its table) and its related rows."""
    return CaseInfo(
        id=case.id,
        name=case.name,
        backend=backend,
        arm=case.arm,
        model=case.model,
        markers=tuple(parse_marker_use(text) for text in markers),
        marker_texts=tuple(markers),
        payload=dict(case.payload),
        kv_bound=KvBound.parse(case.kv_bound),
        startup_timeout_s=case.startup_timeout_s,
        request_timeout_s=case.request_timeout_s,
        launch=launch_table(case.arm, case.launch),  # typed once, here: cells read its fields
        source_dir=case.source_dir,
        version_constraint=case.version_constraint,
        required_fixes=tuple(fixes),
        weights_gib=case.weights_gib,
        enabled=case.enabled,
        traffic=stored_traffic(case.launch.get(TRAFFIC_KEY)),
    )


def runtime_info(runtime: Runtime) -> RuntimeInfo:
    return _runtime_info(runtime, runtime.backend.name, {c.name: c.version for c in runtime.components})


def _runtime_info(runtime: Any, backend: str, components: Mapping[str, str]) -> RuntimeInfo:
    """A `RuntimeInfo` from a runtime's columns (an ORM `Runtime` or a row of its table) and its components."""
    return RuntimeInfo(
        id=runtime.id,
        backend=backend,
        version=runtime.version,
        tag=runtime.tag,
        channel=runtime.channel,
        provider=dict(runtime.provider),
        components=dict(components),
        enabled=runtime.enabled,
        derived=runtime.source == "derived",
    )


def load_catalog_view(session: Session) -> tuple[list[CaseInfo], list[RuntimeInfo], set[str], set[str]]:
    """Active cases and runtimes, plus the names of known markers and backends.

    Read with SQLAlchemy Core from the models' tables: planning wants plain rows, and the ORM's first
    query in a process configures every mapper of the schema and builds its loaders, about a third of
    `matrix plan`'s own work. Related rows come in one query per table (no query per case).
    """
    backend_t, case_t, case_marker_t = Backend.__table__, Case.__table__, CaseMarker.__table__
    case_fix_t, fix_t, marker_t = CaseFix.__table__, Fix.__table__, Marker.__table__
    runtime_t, component_t = Runtime.__table__, RuntimeComponent.__table__
    backend_names = {id_: name for id_, name in session.execute(select(backend_t.c.id, backend_t.c.name))}

    active_cases = case_t.c.retired.is_(False)
    markers: dict[int, list[str]] = {}
    marker_rows = session.execute(
        select(case_marker_t.c.case_id, case_marker_t.c.text)
        .join(case_t, case_t.c.id == case_marker_t.c.case_id)
        .where(active_cases)
        .order_by(case_marker_t.c.id)  # the order `Case.markers` has
    )
    for case_id, text in marker_rows:
        markers.setdefault(case_id, []).append(text)
    fixes: dict[int, list[RequiredFix]] = {}
    fix_rows = session.execute(
        select(case_fix_t.c.case_id, fix_t.c.key, fix_t.c.component, fix_t.c.fixed_in, fix_t.c.link)
        .join(fix_t, fix_t.c.id == case_fix_t.c.fix_id)
        .join(case_t, case_t.c.id == case_fix_t.c.case_id)
        .where(active_cases)
        .order_by(case_fix_t.c.id)
    )
    for case_id, key, component, fixed_in, link in fix_rows:
        fixes.setdefault(case_id, []).append(RequiredFix(key, component, tuple(fixed_in), link))
    cases = [
        _case_info(row, backend_names[row.backend_id], markers.get(row.id, []), fixes.get(row.id, []))
        for row in session.execute(select(case_t).where(active_cases).order_by(case_t.c.name))
    ]

    active_runtimes = runtime_t.c.retired.is_(False)
    components: dict[int, dict[str, str]] = {}
    component_rows = session.execute(
        select(component_t.c.runtime_id, component_t.c.name, component_t.c.version)
        .join(runtime_t, runtime_t.c.id == component_t.c.runtime_id)
        .where(active_runtimes)
        .order_by(component_t.c.name)  # the order `Runtime.components` has
    )
    for runtime_id, name, version in component_rows:
        components.setdefault(runtime_id, {})[name] = version
    runtimes = [
        _runtime_info(row, backend_names[row.backend_id], components.get(row.id, {}))
        for row in session.execute(select(runtime_t).where(active_runtimes).order_by(runtime_t.c.id))
    ]

    known_markers = set(session.scalars(select(marker_t.c.name).where(marker_t.c.retired.is_(False))))
    known_backends = set(session.scalars(select(backend_t.c.name).where(backend_t.c.retired.is_(False))))
    return cases, runtimes, known_markers, known_backends


def plan_from_db(session: Session, selection: Selection) -> Plan:
    cases, runtimes, markers, backends = load_catalog_view(session)
    return make_plan(cases, runtimes, selection, known_markers=markers, known_backends=backends)


def of_new_runtimes(session: Session, cells: Sequence[Cell]) -> list[Cell]:
    """The cells whose runtime nobody has run yet (`run --new`, `plan --new`: e.g. just added by discover)."""
    ran = set(session.scalars(select(CellRun.runtime_id).distinct()))
    return [cell for cell in cells if cell.runtime.id not in ran]


LISTINGS: dict[str, Callable[..., Listing]] = {
    "backends": list_backends,
    "runtimes": list_runtimes,
    "markers": list_markers,
    "cases": list_cases,
    "fixes": list_fixes,
    "gates": list_gates,
}

__all__: Sequence[str] = ["LISTINGS"]
