"""Read results for reports: the catalog rows in scope and every attempt, in a few queries.

Reports must stay fast on a database of 100,000 attempts, so nothing here walks ORM relationships per
row. The catalog (runtimes, cases with markers and fixes) is loaded with `selectinload`; attempts are
read with plain column selects into small slotted dataclasses and grouped in Python. Two shapes:

* `AttemptRow`: the columns an index, a comparison or a gate needs, for every attempt at once;
* `AttemptDetail`: every column, read one runtime at a time for its page, so memory stays bounded by
  the largest page rather than the whole database.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from packaging.version import Version
from sqlalchemy import Select, String, select, type_coerce
from sqlalchemy.orm import Session, selectinload

from matrix.catalog.queries import case_info, runtime_info
from matrix.cells import CaseInfo, RuntimeInfo
from matrix.db.models import (
    Backend,
    Campaign,
    Case,
    CaseFix,
    CaseMarker,
    CellRun,
    Marker,
    Runtime,
    utcnow,
)
from matrix.outcome import FINISHED_STATUSES, SKIPPED, STORED_COLUMNS, interruption, later_skip, standing_attempt
from matrix.owners import orphaned_running, shown_campaign_status
from matrix.plan import Selection, make_plan, missing_fixes
from matrix.versions import parse_version

__all__ = [
    "AttemptDetail",
    "AttemptRow",
    "CampaignView",
    "CaseView",
    "ResultCell",
    "Results",
    "RuntimeView",
    "load_details",
    "load_results",
    "load_skip_reasons",
]

CellKey = tuple[int, int]  # (case id, runtime id)


@dataclass(frozen=True, slots=True)
class RuntimeView:
    """A runtime version as reports show it."""

    id: int
    backend: str
    version: str
    parsed: Version
    tag: str
    channel: str
    provider: Mapping[str, Any]
    components: Mapping[str, str]
    enabled: bool
    retired: bool
    notes: str
    info: RuntimeInfo

    @property
    def label(self) -> str:
        return f"{self.backend}-{self.version}"

    @property
    def spec(self) -> str:
        """The command-line spelling, BACKEND=VERSION."""
        return f"{self.backend}={self.version}"


@dataclass(frozen=True, slots=True)
class CaseView:
    """A case as reports show it; `info` is the planner's view, used for missing fixes."""

    id: int
    name: str
    backend: str
    description: str
    retired: bool
    info: CaseInfo


def raw_column(column: Any) -> Any:
    """Select a JSON or datetime column as the text it is stored as, and decode it here.

    SQLAlchemy's per-value result processing costs more than the report's own work at 100,000 rows;
    one `json.loads` per row (several columns joined) and `datetime.fromisoformat` are much cheaper.
    Drivers that decode such columns natively (PostgreSQL's) still hand back objects: both are handled.
    """
    return type_coerce(column, String).label(column.key)


def _datetime(value: Any) -> dt.datetime | None:
    if value is None or isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromisoformat(str(value))


def _json_columns(values: Sequence[Any]) -> list[Any]:
    """Decode several raw JSON column values, in one `json.loads` when all are text."""
    if all(isinstance(v, str) or v is None for v in values):
        return list(json.loads("[" + ",".join("null" if v is None else v for v in values) + "]"))
    return [json.loads(v) if isinstance(v, str) else v for v in values]


def _checks(value: Any) -> Sequence[Mapping[str, Any]]:
    if value is None or value == "[]":
        return ()
    decoded = json.loads(value) if isinstance(value, str) else value
    return decoded if isinstance(decoded, list) else ()


_SUMMARY_COLUMNS = (
    CellRun.id,
    CellRun.campaign_id,
    CellRun.case_id,
    CellRun.runtime_id,
    CellRun.attempt,
    CellRun.status,
    CellRun.failure_kind,
    CellRun.flaky,
    CellRun.expected_failure,
    CellRun.unexpected_pass,
    CellRun.ready_s,
    CellRun.request_s,
    CellRun.total_s,
    raw_column(CellRun.checks),
)


class AttemptRow(NamedTuple):
    """The columns of one attempt that summaries need (no message, logs or payloads).

    A named tuple rather than a frozen dataclass: just as immutable, and several times cheaper to
    build, which matters at 100,000 rows.
    """

    id: int
    campaign_id: int
    case_id: int
    runtime_id: int
    attempt: int
    status: str
    failure_kind: str | None
    flaky: bool
    expected_failure: str
    unexpected_pass: bool
    ready_s: float | None
    request_s: float | None
    total_s: float | None
    checks: Sequence[Mapping[str, Any]]

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def check_names(self) -> list[str]:
        """The failed checks' names, each saying which request failed it when it is not the main one: the
        streaming request runs the same checks (`matrix.check.streaming`), so a bare "completion_tokens,
        completion_tokens" would not say which answer was wrong."""
        return [_check_label(c) for c in self.checks if isinstance(c, Mapping)]


def _check_label(check: Mapping[str, Any]) -> str:
    name = str(check.get("name", ""))
    message = check.get("message")
    if isinstance(message, str) and message.startswith("stream: ") and name != "stream":
        return f"{name} (stream request)"
    return name


class AttemptDetail(NamedTuple):
    """Every column of one attempt, for a runtime page, JUnit or JSON (a named tuple, like `AttemptRow`)."""

    id: int
    uid: str
    campaign_id: int
    case_id: int
    runtime_id: int
    attempt: int
    status: str
    failure_kind: str | None
    message: str
    checks: Sequence[Mapping[str, Any]]
    expected_failure: str
    unexpected_pass: bool
    flaky: bool
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    owner_host: str
    owner_pid: int | None
    ready_s: float | None
    request_s: float | None
    ttft_s: float | None
    teardown_s: float | None
    total_s: float | None
    prefill_worker_id: str | None
    decode_worker_id: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    finish_reason: str | None
    completion_excerpt: str
    ports: Mapping[str, Any]
    exit_codes: Mapping[str, Any]
    log_dir: str
    gpu: Mapping[str, Any]
    peaks: Mapping[str, Any]
    components: Mapping[str, Any]
    kv_ledger: Mapping[str, Any]
    listeners: Sequence[Mapping[str, Any]]

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES


# The outcome columns stored as JSON (`STORED_COLUMNS` of type list or dict), read back as those types.
_JSON_FIELDS = tuple(name for name, types in STORED_COLUMNS.items() if types[0] in (list, dict))
_DATETIME_FIELDS = ("started_at", "finished_at")
_DETAIL_FIELDS = AttemptDetail._fields
_DETAIL_COLUMNS = tuple(
    raw_column(getattr(CellRun, name)) if name in _JSON_FIELDS + _DATETIME_FIELDS else getattr(CellRun, name)
    for name in _DETAIL_FIELDS
)
_JSON_INDEX = tuple(_DETAIL_FIELDS.index(name) for name in _JSON_FIELDS)
_DATETIME_INDEX = tuple(_DETAIL_FIELDS.index(name) for name in _DATETIME_FIELDS)


def _detail(row: Sequence[Any]) -> AttemptDetail:
    values = list(row)
    for index, decoded in zip(_JSON_INDEX, _json_columns([values[i] for i in _JSON_INDEX]), strict=True):
        values[index] = decoded if decoded is not None else STORED_COLUMNS[_DETAIL_FIELDS[index]][0]()
    for index in _DATETIME_INDEX:
        values[index] = _datetime(values[index])
    return AttemptDetail(*values)


@dataclass(frozen=True, slots=True)
class CampaignView:
    id: int
    status: str
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    selection: Mapping[str, Any]
    host: str
    executor: str
    git_sha: str
    matrix_version: str

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (_aware(self.finished_at) - _aware(self.started_at)).total_seconds()


def _aware(value: dt.datetime) -> dt.datetime:
    # SQLite hands back naive datetimes for timezone-aware columns; they were written in UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)



@dataclass
class ResultCell:
    """One case on one runtime within a report's scope, with its attempts oldest first."""

    case: CaseView
    runtime: RuntimeView
    attempts: list[AttemptRow] = field(default_factory=list)
    # Why the planner expects this cell to fail ("lacks vllm#54814: ..."), from the catalog as it is now.
    missing: tuple[str, ...] = ()

    @functools.cached_property
    def latest(self) -> AttemptRow | None:
        """The attempt that stands for the cell (computed once: attempts are complete after loading)."""
        return standing_attempt(self.attempts)

    @functools.cached_property
    def later_skip(self) -> AttemptRow | None:
        """A skip (or not-run) after the attempt that stands for the cell, if any."""
        return later_skip(self.attempts, self.latest)

    @property
    def key(self) -> str:
        return f"{self.case.name}@{self.runtime.label}"

    def expected_failure(self, attempt: AttemptRow | AttemptDetail | None) -> str:
        """Why the cell is expected to fail, as a reader shows it: what the attempt stored (the catalog when it
        ran) when it stored anything, else today's catalog (`missing`), so a fix added since still shows."""
        stored = attempt.expected_failure if attempt is not None else ""
        return stored or "; ".join(self.missing)


@dataclass
class Results:
    """Everything in a report's scope: runtimes (backend, then PEP 440 order), cases, cells, campaigns.

    `excluded` says, for a case and runtime of the same backend that are both in scope but form no
    cell, why the planner leaves that combination out (a version constraint, a disabled case...).
    """

    runtimes: list[RuntimeView]
    cases: list[CaseView]
    cells: dict[CellKey, ResultCell]
    excluded: dict[CellKey, str]
    campaigns: list[CampaignView]
    selection: Selection | None = None
    campaign_id: int | None = None
    _by_runtime: dict[int, list[ResultCell]] | None = field(default=None, repr=False)

    def backends(self) -> list[str]:
        return sorted({r.backend for r in self.runtimes} | {c.backend for c in self.cases})

    def runtimes_of(self, backend: str) -> list[RuntimeView]:
        return [r for r in self.runtimes if r.backend == backend]

    def cases_of(self, backend: str) -> list[CaseView]:
        return [c for c in self.cases if c.backend == backend]

    def cells_of_runtime(self, runtime_id: int) -> list[ResultCell]:
        """The runtime's cells by case name (an index built once: reports ask for every runtime)."""
        if self._by_runtime is None:
            self._by_runtime = defaultdict(list)
            for (_, rid), cell in self.cells.items():
                self._by_runtime[rid].append(cell)
            for found in self._by_runtime.values():
                found.sort(key=lambda c: c.case.name)
        return list(self._by_runtime.get(runtime_id, []))

    def attempts(self) -> Iterator[AttemptRow]:
        for cell in self.cells.values():
            yield from cell.attempts


def _runtime_view(row: Runtime) -> RuntimeView:
    return RuntimeView(
        id=row.id,
        backend=row.backend.name,
        version=row.version,
        parsed=parse_version(row.version),
        tag=row.tag,
        channel=row.channel,
        provider=dict(row.provider),
        components={c.name: c.version for c in row.components},
        enabled=row.enabled,
        retired=row.retired,
        notes=row.notes,
        info=runtime_info(row),
    )


def load_runtimes(session: Session) -> list[RuntimeView]:
    """Every runtime, retired ones included (their results keep their meaning), backend then PEP 440."""
    rows = session.scalars(
        select(Runtime).options(selectinload(Runtime.backend), selectinload(Runtime.components))
    ).all()
    return sorted((_runtime_view(r) for r in rows), key=lambda r: (r.backend, r.parsed))


def load_cases(session: Session) -> list[CaseView]:
    """Every case, retired ones included, by name."""
    rows = session.scalars(
        select(Case).options(
            selectinload(Case.backend),
            selectinload(Case.markers).selectinload(CaseMarker.marker),
            selectinload(Case.fixes).selectinload(CaseFix.fix),
        )
    ).all()
    views = [CaseView(c.id, c.name, c.backend.name, c.description, c.retired, case_info(c)) for c in rows]
    return sorted(views, key=lambda c: c.name)


def load_campaigns(session: Session) -> list[CampaignView]:
    """Every campaign, a `running` one whose runners are all gone shown `interrupted` (`matrix.owners`)."""
    rows = session.scalars(select(Campaign).order_by(Campaign.id)).all()
    now = utcnow()
    return [
        CampaignView(
            c.id, shown_campaign_status(session, c, now), c.started_at, c.finished_at, dict(c.selection), c.host,
            c.executor, c.git_sha, c.matrix_version,
        )
        for c in rows
    ]  # fmt: skip


def iter_attempt_rows(session: Session, stmt_filter: Iterable[Any] = ()) -> Iterator[AttemptRow]:
    """Summaries of attempts (oldest first), filtered by the given SQL conditions."""
    # Skew cells' attempts (roles_key set) are the skew pages' (`matrix.report.skew`): in the diagonal's
    # views they would pass for attempts of the diagonal cell of decode's runtime.
    stmt: Select[Any] = select(*_SUMMARY_COLUMNS).where(CellRun.roles_key == "").order_by(CellRun.id)
    for condition in stmt_filter:
        stmt = stmt.where(condition)
    # A running row whose runner was killed is interrupted for every reader, though only the next
    # `matrix run` writes that down (its processes are gone: the watchdog killed them).
    orphans = orphaned_running(session, utcnow())
    for row in session.execute(stmt):
        (rid, campaign, case, runtime, attempt, status, kind, flaky, expected, unexpected, ready, request, total,
         checks) = row  # fmt: skip
        if rid in orphans:  # only running rows are ever orphans
            status, kind = ORPHANED.status, ORPHANED.failure_kind
        yield AttemptRow(
            rid, campaign, case, runtime, attempt, status, kind, bool(flaky), expected or "", bool(unexpected),
            ready, request, total, _checks(checks),
        )  # fmt: skip


def load_skip_reasons(session: Session, results: Results) -> dict[int, str]:
    """Attempt id -> why it was skipped (the first line of its message), for the skipped attempts in scope.

    Summaries carry no messages (they would weigh on a 100,000-attempt report); skips are few and each one
    must say why wherever it is shown."""
    wanted = {a.id for cell in results.cells.values() for a in cell.attempts if a.status == SKIPPED}
    if not wanted:
        return {}
    found = {}
    for attempt_id, message in session.execute(
        select(CellRun.id, CellRun.message).where(CellRun.status == SKIPPED)
    ):
        if attempt_id in wanted:
            found[attempt_id] = (str(message or "").strip().splitlines() or [""])[0]
    return found


ORPHAN_MESSAGE = "its runner is gone (killed or crashed): interrupted; the next matrix run records it so\n"
# How a reader shows a running row whose runner is gone (the next `matrix run` writes the same).
ORPHANED = interruption(ORPHAN_MESSAGE)


def load_details(
    session: Session, runtime_id: int, *, case_ids: Iterable[int] | None = None, campaign_id: int | None = None
) -> dict[int, list[AttemptDetail]]:
    """Every column of the attempts on one runtime, grouped by case id, oldest first.

    `case_ids` filters in Python, not in SQL: a long ``IN`` list can lead SQLite to the case index and
    to scanning every attempt of those cases on every runtime.
    """
    stmt: Select[Any] = (
        select(*_DETAIL_COLUMNS).where(CellRun.runtime_id == runtime_id, CellRun.roles_key == "").order_by(CellRun.id)
    )
    if campaign_id is not None:
        stmt = stmt.where(CellRun.campaign_id == campaign_id)
    wanted = set(case_ids) if case_ids is not None else None
    grouped: dict[int, list[AttemptDetail]] = defaultdict(list)
    orphans = orphaned_running(session, utcnow())
    for row in session.execute(stmt):
        if wanted is None or row.case_id in wanted:
            detail = _detail(row)
            if detail.id in orphans:
                shown = interruption(f"{ORPHAN_MESSAGE}{detail.message}")
                detail = detail._replace(status=shown.status, failure_kind=shown.failure_kind, message=shown.message)
            grouped[detail.case_id].append(detail)
    return grouped


def load_details_of(session: Session, attempt_ids: Iterable[int]) -> dict[int, AttemptDetail]:
    """Every column of the given attempts, by id: what an export prints of the few attempts it shows,
    without reading the whole history of their cells (whose summaries chose them)."""
    ids = sorted(set(attempt_ids))
    found: dict[int, AttemptDetail] = {}
    if not ids:
        return found
    orphans = orphaned_running(session, utcnow())
    for start in range(0, len(ids), 500):  # bounded IN lists: SQLite's variable limit, one plan per chunk
        chunk = ids[start : start + 500]
        for row in session.execute(select(*_DETAIL_COLUMNS).where(CellRun.id.in_(chunk))):
            detail = _detail(row)
            if detail.id in orphans:  # shown as `load_details` shows it
                shown = interruption(f"{ORPHAN_MESSAGE}{detail.message}")
                detail = detail._replace(status=shown.status, failure_kind=shown.failure_kind, message=shown.message)
            found[detail.id] = detail
    return found


def load_results(session: Session, selection: Selection | None = None, *, campaign_id: int | None = None) -> Results:
    """The report's scope and its attempts.

    Without a selection, the scope is every cell the planner makes of the catalog as it is now, plus
    every case and runtime that has results (retired ones included). With a selection, it is exactly
    the cells that `matrix plan` with the same options lists. With a campaign, it is the cells that
    campaign ran (within the selection, if one is given), and only its attempts count.
    """
    runtimes = load_runtimes(session)
    cases = load_cases(session)
    runtime_by_id = {r.id: r for r in runtimes}
    case_by_id = {c.id: c for c in cases}
    known_markers = set(session.scalars(select(Marker.name).where(Marker.retired.is_(False))))
    known_backends = set(session.scalars(select(Backend.name).where(Backend.retired.is_(False))))
    plan = make_plan(
        [c.info for c in cases if not c.retired],
        [r.info for r in runtimes if not r.retired],
        selection or Selection(),
        known_markers=known_markers,
        known_backends=known_backends,
    )
    planned = {}
    for planned_cell in plan.cells:
        assert planned_cell.case.id is not None and planned_cell.runtime.id is not None
        planned[(planned_cell.case.id, planned_cell.runtime.id)] = planned_cell.missing_reasons
    cells: dict[CellKey, ResultCell] = {}
    if campaign_id is None:  # planned cells show even before their first attempt
        for key, missing in planned.items():
            cells[key] = ResultCell(case_by_id[key[0]], runtime_by_id[key[1]], missing=missing)
    conditions = [CellRun.campaign_id == campaign_id] if campaign_id is not None else []
    for attempt in iter_attempt_rows(session, conditions):
        key = (attempt.case_id, attempt.runtime_id)
        cell = cells.get(key)
        if cell is None:
            if selection is not None and key not in planned:
                continue  # a selection scopes the report to the cells it plans
            case, runtime = case_by_id[attempt.case_id], runtime_by_id[attempt.runtime_id]
            why = planned.get(key) or tuple(reason for _, reason in missing_fixes(case.info, runtime.info))
            cell = cells[key] = ResultCell(case, runtime, missing=why)
        cell.attempts.append(attempt)
    in_runtimes = {rid for _, rid in cells}
    in_cases = {cid for cid, _ in cells}
    case_ids = {c.name: c.id for c in cases}
    runtime_ids = {r.label: r.id for r in runtimes}
    excluded: dict[CellKey, str] = {}
    for exclusion in plan.excluded:
        key = (case_ids.get(exclusion.case, -1), runtime_ids.get(exclusion.runtime, -1))
        if key[0] in in_cases and key[1] in in_runtimes and key not in cells:
            excluded[key] = exclusion.reason
    return Results(
        runtimes=[r for r in runtimes if r.id in in_runtimes],
        cases=[c for c in cases if c.id in in_cases],
        cells=cells,
        excluded=excluded,
        campaigns=[c for c in load_campaigns(session) if campaign_id is None or c.id == campaign_id],
        selection=selection,
        campaign_id=campaign_id,
    )
