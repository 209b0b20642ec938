"""Apply a validated `CatalogSpec` to the database idempotently.

Rows are matched by their natural key (backend name, backend+version, marker name, fix key, case name,
gate name). Entries that are new are added, entries that differ are updated, and rows that came from
the files being synced but that they no longer list are *retired* (hidden from plans and lists), never
deleted: results keep pointing at them. Each row records its file (`source_file`), so syncing one file
never retires what another file (the seed catalog, say) defined. `prune=True` (`--prune`) retires every
catalog row of a kind the files define that they do not list, whatever its file. Runtimes and markers
added from the command line (`source = "cli"`) or by `matrix discover` (`"discovered"`) are left alone either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session, object_session

from matrix.arm_table import parse_launch
from matrix.catalog.spec import CaseSpec, CatalogSpec, RuntimeSpec
from matrix.db.models import (
    Backend,
    Case,
    CaseFix,
    CaseMarker,
    Fix,
    GatePolicy,
    Marker,
    Runtime,
    RuntimeComponent,
    Waiver,
)
from matrix.errors import ConfigError
from matrix.launch.options import AGGREGATED_ARMS, ARMS, check_equivalence
from matrix.markers import Expression, check_known, parse_marker_use
from matrix.traffic_profile import TRAFFIC_KEY

RowT = TypeVar("RowT")


@dataclass(frozen=True)
class Change:
    action: str  # added | changed | retired | restored
    kind: str
    name: str
    detail: str = ""


# Where a case's files are read from, not what the catalog says: the same files reached through another path
# (an installed wheel, then an editable checkout) update it without counting as a change.
LOCATION_ONLY = frozenset({"source_dir"})


@dataclass
class SyncReport:
    changes: list[Change] = field(default_factory=list)
    relocated: list[str] = field(default_factory=list)  # cases whose source_dir alone moved

    def count(self, action: str) -> int:
        return sum(1 for c in self.changes if c.action == action)

    def summary(self) -> str:
        if not self.changes:
            return "0 changes"
        parts = [f"{self.count(a)} {a}" for a in ("added", "changed", "restored", "retired") if self.count(a)]
        return f"{len(self.changes)} changes: " + ", ".join(parts)


def _update(row: object, values: Mapping[str, Any]) -> list[str]:
    """Set the attributes that differ; return their names."""
    changed = [k for k, v in values.items() if getattr(row, k) != v]
    for key in changed:
        setattr(row, key, values[key])
    return changed


class _Syncer:
    def __init__(self, session: Session, spec: CatalogSpec, *, prune: bool = False) -> None:
        self.session, self.spec, self.report, self.prune = session, spec, SyncReport(), prune

    def record(self, action: str, kind: str, name: str, detail: str = "") -> None:
        self.report.changes.append(Change(action, kind, name, detail))

    def upsert(
        self, kind: str, name: str, existing: RowT | None, make: Callable[[], RowT], values: Mapping[str, Any],
        key: Any = None,
    ) -> RowT:  # fmt: skip
        # Where the entry comes from is bookkeeping, not a change worth printing.
        source = self.spec.sources.get((kind, name if key is None else key), "")
        if existing is None:
            row = make()
            _update(row, values)
            row.source_file = source  # type: ignore[attr-defined]
            self.session.add(row)
            self.record("added", kind, name)
            return row
        if getattr(existing, "source_file", source) != source:
            existing.source_file = source  # type: ignore[attr-defined]
        changed = _update(existing, values)
        if getattr(existing, "retired", False):
            existing.retired = False  # type: ignore[attr-defined]
            self.record("restored", kind, name)
        elif changed and set(changed) <= LOCATION_ONLY:
            self.report.relocated.append(name)
        elif changed:
            self.record("changed", kind, name, ", ".join(c for c in changed if c not in LOCATION_ONLY))
        return existing

    def retire_missing(self, kind: str, rows: Iterable[Any], keep: set[Any], key: Callable[[Any], Any]) -> None:
        if self.prune and kind not in self.spec.kinds:
            return
        for row in rows:
            if row.retired or key(row) in keep or getattr(row, "source", "catalog") != "catalog":
                continue
            if not self.prune and row.source_file not in self.spec.files:
                continue  # defined by another file (or before sources were recorded): not this sync's to retire
            row.retired = True
            name = key(row)
            self.record("retired", kind, " ".join(name).strip() if isinstance(name, tuple) else str(name))

    # --- kinds, in dependency order -------------------------------------------------------------
    def backends(self) -> dict[str, Backend]:
        rows = {b.name: b for b in self.session.scalars(select(Backend))}
        for b in self.spec.backends:
            rows[b.name] = self.upsert(
                "backend", b.name, rows.get(b.name), Backend,
                {"name": b.name, "description": b.description, "runtime_template": b.runtime_template},
            )  # fmt: skip
        self.retire_missing("backend", list(rows.values()), {b.name for b in self.spec.backends}, lambda r: r.name)
        return {name: row for name, row in rows.items() if not row.retired}

    def markers(self) -> dict[str, Marker]:
        rows = {m.name: m for m in self.session.scalars(select(Marker))}
        for m in self.spec.markers:
            values = {
                "name": m.name,
                "kind": m.kind,
                "description": m.description,
                "parametrised": m.parametrised,
                "source": "catalog",
            }
            rows[m.name] = self.upsert("marker", m.name, rows.get(m.name), Marker, values)
        self.retire_missing("marker", list(rows.values()), {m.name for m in self.spec.markers}, lambda r: r.name)
        return {name: row for name, row in rows.items() if not row.retired}

    def fixes(self) -> dict[str, Fix]:
        rows = {f.key: f for f in self.session.scalars(select(Fix))}
        for f in self.spec.fixes:
            values = {
                "key": f.key,
                "component": f.component,
                "fixed_in": f.fixed_in,
                "link": f.link,
                "description": f.description,
            }
            rows[f.key] = self.upsert("fix", f.key, rows.get(f.key), Fix, values)
        self.retire_missing("fix", list(rows.values()), {f.key for f in self.spec.fixes}, lambda r: r.key)
        return {key: row for key, row in rows.items() if not row.retired}

    def runtimes(self, backends: Mapping[str, Backend]) -> None:
        rows = {(r.backend.name, r.version): r for r in self.session.scalars(select(Runtime))}
        for r in self.spec.runtimes:
            backend = _lookup(backends, r.backend, "backend", f"runtime {r.backend} {r.version}")
            row = self.upsert(
                "runtime", f"{r.backend} {r.version}", rows.get(r.key), Runtime, _runtime_values(r, backend), r.key
            )
            rows[r.key] = row
            if _sync_components(row, r.components) and self.report.changes[-1:] != [
                Change("added", "runtime", f"{r.backend} {r.version}")
            ]:
                self.record("changed", "runtime", f"{r.backend} {r.version}", "components")
        keep = {r.key for r in self.spec.runtimes}
        self.retire_missing("runtime", list(rows.values()), keep, lambda r: (r.backend.name, r.version))

    def cases(self, backends: Mapping[str, Backend], markers: Mapping[str, Marker], fixes: Mapping[str, Fix]) -> None:
        rows = {c.name: c for c in self.session.scalars(select(Case))}
        arms = ARMS
        for c in self.spec.cases:
            where = f"case {c.name!r}"
            backend = _lookup(backends, c.backend, "backend", where)
            if c.arm not in arms:
                raise ConfigError(f"{where}: unknown arm {c.arm!r}; known arms: {', '.join(sorted(arms))}")
            if check_equivalence(c.name, parse_launch(c.arm, c.launch).equivalence) is not None and (
                c.arm not in AGGREGATED_ARMS
            ):
                raise ConfigError(
                    f"{where}: arm {c.arm} cannot launch an aggregated instance for launch.equivalence; "
                    "use an arm that can (reference, vllm_native) or remove launch.equivalence"
                )
            row = self.upsert("case", c.name, rows.get(c.name), Case, _case_values(c, backend))
            rows[c.name] = row
            detail = []
            if _sync_case_markers(row, c, markers, where):
                detail.append("markers")
            if _sync_case_fixes(row, c, fixes, where):
                detail.append("fixes")
            if detail and self.report.changes[-1:] != [Change("added", "case", c.name)]:
                self.record("changed", "case", c.name, ", ".join(detail))
        self.retire_missing("case", list(rows.values()), {c.name for c in self.spec.cases}, lambda r: r.name)

    def gates(self, markers: Mapping[str, Marker]) -> None:
        rows = {g.name: g for g in self.session.scalars(select(GatePolicy))}
        for g in self.spec.gates:
            expression = Expression.compile(g.expression)
            check_known(expression, markers)
            values = {
                "name": g.name,
                "expression": g.expression,
                "description": g.description,
                "rules": g.rules,
            }
            rows[g.name] = self.upsert("gate", g.name, rows.get(g.name), GatePolicy, values)
        self.retire_missing("gate", list(rows.values()), {g.name for g in self.spec.gates}, lambda r: r.name)

    def waivers(self) -> None:
        cases = {c.name: c for c in self.session.scalars(select(Case).where(Case.retired.is_(False)))}
        rows = list(self.session.scalars(select(Waiver)))
        by_key = {(w.case.name, w.runtime_spec): w for w in rows}
        for w in self.spec.waivers:
            case = _lookup(cases, w.case, "case", "waiver")
            values = {
                "case": case,
                "runtime_spec": w.runtime_spec,
                "reason": w.reason,
                "link": w.link,
                "expires": w.expires,
                "owner": w.owner,
            }
            self.upsert(
                "waiver",
                f"{w.case} {w.runtime_spec}".strip(),
                by_key.get((w.case, w.runtime_spec)),
                Waiver,
                values,
                (w.case, w.runtime_spec),
            )
        keep = {(w.case, w.runtime_spec) for w in self.spec.waivers}
        self.retire_missing("waiver", rows, keep, lambda r: (r.case.name, r.runtime_spec))


def _lookup(rows: Mapping[str, RowT], name: str, kind: str, where: str) -> RowT:
    if name not in rows:
        known = ", ".join(sorted(rows)) or "none"
        raise ConfigError(f"{where}: unknown {kind} {name!r}; known {kind}s: {known}")
    return rows[name]


def _runtime_values(r: RuntimeSpec, backend: Backend) -> dict[str, Any]:
    return {
        "backend": backend,
        "version": r.version,
        "tag": r.tag,
        "channel": r.channel,
        "provider": r.provider,
        "enabled": r.enabled,
        "notes": r.notes,
        "source": "catalog",
    }


def _sync_components(row: Runtime, components: Mapping[str, str]) -> bool:
    current = {c.name: c.version for c in row.components}
    if current == dict(components):
        return False
    row.components.clear()
    row.components.extend(RuntimeComponent(name=n, version=v) for n, v in sorted(components.items()))
    return True


def _case_values(c: CaseSpec, backend: Backend) -> dict[str, Any]:
    return {
        "name": c.name,
        "backend": backend,
        "arm": c.arm,
        "model": c.model,
        "description": c.description,
        "payload": c.payload,
        "kv_bound": c.kv_bound.as_dict(),
        "startup_timeout_s": c.startup_timeout_s,
        "request_timeout_s": c.request_timeout_s,
        # The traffic profile rides in the launch column under a key no launch table has (`TRAFFIC_KEY`).
        "launch": {**c.launch, TRAFFIC_KEY: c.traffic.as_dict()} if c.traffic else c.launch,
        "source_dir": c.source_dir,
        "version_constraint": c.version_constraint,
        "weights_gib": c.weights_gib,
        "enabled": c.enabled,
    }


def _sync_case_markers(row: Case, c: CaseSpec, markers: Mapping[str, Marker], where: str) -> bool:
    wanted: list[tuple[Marker, str]] = []
    for text in c.markers:
        use = parse_marker_use(text)
        marker = markers.get(use.name)
        if marker is None:
            check_known(Expression.compile(use.name), markers)  # raises with close matches
            raise ConfigError(f"{where}: unknown marker {use.name!r}")  # pragma: no cover - defensive
        has_args = bool(use.args or use.kwargs)
        if marker.parametrised and not has_args:
            raise ConfigError(f"{where}: marker {use.name!r} needs a value, e.g. {use.name}(2048)")
        if has_args and not marker.parametrised:
            raise ConfigError(f"{where}: marker {use.name!r} takes no value; write {use.name}")
        wanted.append((marker, text))
    if len({m.name for m, _ in wanted}) != len(wanted):
        raise ConfigError(f"{where}: a marker is listed twice in {c.markers!r}")
    current = [(cm.marker.name, cm.text) for cm in row.markers]
    if current == [(m.name, t) for m, t in wanted]:
        return False
    row.markers.clear()
    _flush(row)
    row.markers.extend(CaseMarker(marker=m, text=t) for m, t in wanted)
    return True


def _sync_case_fixes(row: Case, c: CaseSpec, fixes: Mapping[str, Fix], where: str) -> bool:
    wanted = [_lookup(fixes, key, "fix", where) for key in c.requires_fixes]
    if sorted(cf.fix.key for cf in row.fixes) == sorted(f.key for f in wanted):
        return False
    row.fixes.clear()
    _flush(row)
    row.fixes.extend(CaseFix(fix=f) for f in wanted)
    return True


def _flush(row: object) -> None:
    """Flush pending deletes so re-adding a child with the same unique key does not collide."""
    session = object_session(row)
    if session is not None:
        session.flush()


def sync_catalog(session: Session, spec: CatalogSpec, *, prune: bool = False) -> SyncReport:
    """Apply `spec`; raises ConfigError (and the caller rolls back) on any cross-reference problem.

    `prune` retires every catalog row of the kinds the files define that they do not list, not only
    rows that came from these files."""
    syncer = _Syncer(session, spec, prune=prune)
    backends = syncer.backends()
    markers = syncer.markers()
    fixes = syncer.fixes()
    syncer.runtimes(backends)
    syncer.cases(backends, markers, fixes)
    syncer.gates(markers)
    syncer.waivers()
    session.flush()
    return syncer.report
