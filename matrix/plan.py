"""Expand cases x runtimes into cells, and say why every other combination was left out.

A case combines with the runtimes of its own backend. A combination is excluded by the selection
(marker expression, --backend, --case, --runtime, --since/--until), by the case's version constraint,
or because the case or runtime is disabled. A runtime that lacks a fix the case requires is *kept* and
annotated: the cell is expected to fail, and a report must say so rather than hide it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version
from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Backend, Case, CaseFix, CaseMarker, Fix, Marker, Runtime, RuntimeComponent
from matrix.errors import ConfigError
from matrix.kv_bound import KvBound
from matrix.markers import Expression, MarkerUse, check_known, matches, parse_marker_use
from matrix.versions import (
    VersionWindow,
    component_has_fix,
    parse_bound,
    parse_specifier,
    parse_version,
    specifier_admits,
)

_GPU_MARKER = re.compile(r"^gpu_(\d+)$")
# A cell's stable id: 12 hex digits (48 bits) of its key's hash. A collision among 10,000 cells has odds of
# about 1 in 5 million, and is detected (`matrix.fanout.shards.index_cells`) rather than silently merging two cells.
_ID_HEX = 12


def cell_id(key: str) -> str:
    """The stable id of a cell key `CASE@BACKEND-VERSION` (database ids change between databases; keys do not)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:_ID_HEX]


@dataclass(frozen=True)
class RequiredFix:
    key: str
    component: str
    fixed_in: tuple[str, ...]
    link: str = ""


@dataclass(frozen=True)
class CaseInfo:
    """The parts of a case that planning and launching need, detached from the database."""

    name: str
    backend: str
    arm: str
    model: str
    markers: tuple[MarkerUse, ...]
    marker_texts: tuple[str, ...] = ()
    payload: Mapping[str, Any] = field(default_factory=dict)
    kv_bound: KvBound = field(default_factory=KvBound)
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 60.0
    launch: Mapping[str, Any] = field(default_factory=dict)
    source_dir: str = ""
    version_constraint: str = ""
    required_fixes: tuple[RequiredFix, ...] = ()
    weights_gib: float = 0.0
    enabled: bool = True
    id: int | None = None

    @property
    def gpus_needed(self) -> int:
        """GPUs the case needs, from its `gpu_N` marker (0 when it has none)."""
        for use in self.markers:
            if m := _GPU_MARKER.match(use.name):
                return int(m.group(1))
        return 0


@dataclass(frozen=True)
class RuntimeInfo:
    backend: str
    version: str
    tag: str
    channel: str = "release"
    provider: Mapping[str, Any] = field(default_factory=dict)
    components: Mapping[str, str] = field(default_factory=dict)
    enabled: bool = True
    id: int | None = None
    # A variant made by `matrix bisect --component` (source "derived"): planned only when named by --runtime.
    derived: bool = False

    @property
    def label(self) -> str:
        return f"{self.backend}-{self.version}"

    @property
    def parsed_version(self) -> Version:
        return parse_version(self.version)


@dataclass(frozen=True)
class Cell:
    case: CaseInfo
    runtime: RuntimeInfo
    # Required fixes this runtime lacks, e.g. ("vllm#54814",): the cell is expected to fail.
    missing_fixes: tuple[str, ...] = ()
    missing_reasons: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.case.name}@{self.runtime.label}"

    @property
    def expected_failure(self) -> str:
        return "; ".join(self.missing_reasons)

    def as_dict(self) -> dict[str, Any]:
        """The cell as `matrix plan --json` prints it."""
        return {
            "cell": self.key, "id": cell_id(self.key), "case": self.case.name, "backend": self.runtime.backend,
            "version": self.runtime.version, "tag": self.runtime.tag, "arm": self.case.arm,
            "gpus": self.case.gpus_needed, "markers": list(self.case.marker_texts),
            "missing_fixes": list(self.missing_fixes), "note": self.expected_failure,
        }  # fmt: skip


@dataclass(frozen=True)
class Exclusion:
    case: str
    runtime: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"case": self.case, "runtime": self.runtime, "reason": self.reason}


@dataclass(frozen=True)
class Selection:
    """What the user asked for on the command line; the same options for `plan` and `run`."""

    marker_expression: str | None = None
    since: tuple[str, ...] = ()
    until: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    cases: tuple[str, ...] = ()
    runtimes: tuple[str, ...] = ()
    strict_markers: bool = True

    def __post_init__(self) -> None:
        # `-m ""` means no marker filter, as on pytest's command line (an empty CI variable must not
        # select nothing and pass).
        if self.marker_expression == "":
            object.__setattr__(self, "marker_expression", None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "marker_expression": self.marker_expression,
            "since": list(self.since),
            "until": list(self.until),
            "backends": list(self.backends),
            "cases": list(self.cases),
            "runtimes": list(self.runtimes),
        }


@dataclass(frozen=True)
class Plan:
    cells: tuple[Cell, ...]
    excluded: tuple[Exclusion, ...]
    selection: Selection

    def as_dict(self, *, explain: bool = False) -> dict[str, Any]:
        """The plan as `matrix plan --json` prints it; `explain` adds the excluded combinations."""
        data: dict[str, Any] = {"cells": [cell.as_dict() for cell in self.cells]}
        if explain:
            data["excluded"] = [exclusion.as_dict() for exclusion in self.excluded]
        return data


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
        launch=dict(case.launch),
        source_dir=case.source_dir,
        version_constraint=case.version_constraint,
        required_fixes=tuple(fixes),
        weights_gib=case.weights_gib,
        enabled=case.enabled,
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


def missing_fixes(case: CaseInfo, runtime: RuntimeInfo) -> list[tuple[str, str]]:
    """(fix key, why) for each required fix the runtime's components lack."""
    missing = []
    for fix in case.required_fixes:
        have = runtime.components.get(fix.component)
        if have is None:
            missing.append((fix.key, f"lacks {fix.key}: runtime lists no {fix.component} component"))
        elif not component_has_fix(parse_version(have), list(fix.fixed_in)):
            missing.append(
                (fix.key, f"lacks {fix.key}: {fix.component} {have} predates the fix; expected to fail")
            )
    return missing


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


def _check_names(kind: str, wanted: Sequence[str], known: set[str]) -> None:
    import difflib

    for name in wanted:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"unknown {kind} {name!r}{hint} (known: {', '.join(sorted(known)) or 'none'}; "
                f"see `matrix {kind}s list`)"
            )


def _runtime_selector(text: str, backends: set[str]) -> tuple[str, Version]:
    """`vllm=0.30.0`, `vllm@v0.30.0` or `vllm-0.30.0` -> (backend, version)."""
    for sep in ("=", "@"):
        if sep in text:
            backend, _, version = text.partition(sep)
            break
    else:
        backend, _, version = text.rpartition("-")
    if not backend or not version:
        raise ConfigError(f"invalid --runtime {text!r}: write BACKEND=VERSION, e.g. vllm=0.30.0")
    _check_names("backend", [backend], backends)
    return backend, parse_version(version)


def make_plan(
    cases: Sequence[CaseInfo],
    runtimes: Sequence[RuntimeInfo],
    selection: Selection,
    *,
    known_markers: set[str],
    known_backends: set[str],
) -> Plan:
    """Pure planning: no database, no processes."""
    expression = None
    if selection.marker_expression is not None:
        expression = Expression.compile(selection.marker_expression)
        if selection.strict_markers:
            check_known(expression, known_markers)
    _check_names("backend", list(selection.backends), known_backends)
    _check_names("case", list(selection.cases), {c.name for c in cases})
    window = VersionWindow(
        since=tuple(parse_bound(s) for s in selection.since),
        until=tuple(parse_bound(u) for u in selection.until),
    )
    for bound in (*window.since, *window.until):
        if bound.backend is not None:
            _check_names("backend", [bound.backend], known_backends)
    wanted_runtimes = {_runtime_selector(r, known_backends) for r in selection.runtimes}
    if wanted_runtimes:
        present = {(r.backend, r.parsed_version) for r in runtimes}
        for backend, version in wanted_runtimes - present:
            raise ConfigError(f"unknown runtime {backend}={version}; see `matrix runtimes list`")

    by_backend: dict[str, list[RuntimeInfo]] = {}
    for runtime in sorted(runtimes, key=lambda r: (r.backend, r.parsed_version)):
        by_backend.setdefault(runtime.backend, []).append(runtime)

    cells: list[Cell] = []
    excluded: list[Exclusion] = []
    for case in cases:
        for runtime in by_backend.get(case.backend, []):
            reason = _exclusion_reason(case, runtime, selection, expression, window, wanted_runtimes)
            if reason:
                excluded.append(Exclusion(case.name, runtime.label, reason))
                continue
            missing = missing_fixes(case, runtime)
            cells.append(Cell(case, runtime, tuple(k for k, _ in missing), tuple(why for _, why in missing)))
        if not by_backend.get(case.backend):
            excluded.append(Exclusion(case.name, "-", f"backend {case.backend} has no runtimes"))
    return Plan(tuple(cells), tuple(excluded), selection)


def _exclusion_reason(
    case: CaseInfo,
    runtime: RuntimeInfo,
    selection: Selection,
    expression: Expression | None,
    window: VersionWindow,
    wanted_runtimes: set[tuple[str, Version]],
) -> str | None:
    if selection.cases and case.name not in selection.cases:
        return "case not selected by --case"
    if selection.backends and case.backend not in selection.backends:
        return "backend not selected by --backend"
    if expression is not None and not matches(expression, case.markers):
        return f"markers {' '.join(case.marker_texts) or '(none)'} not selected by -m {expression.text!r}"
    if not case.enabled:
        return "case is disabled"
    if wanted_runtimes and (runtime.backend, runtime.parsed_version) not in wanted_runtimes:
        return "runtime not selected by --runtime"
    if runtime.derived and not wanted_runtimes:
        return "a derived variant (runtime derive, run --with, bisect --component): name it with --runtime to run it"
    admitted, why = window.admits(runtime.backend, runtime.parsed_version)
    if not admitted:
        return why or "outside the version window"
    if case.version_constraint and not specifier_admits(
        parse_specifier(case.version_constraint), runtime.parsed_version
    ):
        return f"version {runtime.version} outside the case's constraint {case.version_constraint}"
    if not runtime.enabled:
        return "runtime is disabled"
    return None


def plan_from_db(session: Session, selection: Selection) -> Plan:
    cases, runtimes, markers, backends = load_catalog_view(session)
    return make_plan(cases, runtimes, selection, known_markers=markers, known_backends=backends)
