"""Merge shard results files into this database: one campaign per campaign key, each attempt once.

Attempts are matched by their uid (the unique MATRIX_CELL_ID of an attempt), so importing a file twice
changes nothing, and two shards of one CI run (one campaign key) land in one campaign. Cases and
runtimes are matched by name and version against this database's catalog; anything missing stops the
import before anything is written.

An attempt number already taken in the campaign by another uid (a shard re-run on a fresh runner starts
at attempt 1 again) is renumbered after the campaign's latest attempt of that cell, so the re-run is the
latest attempt, as it is in time.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Backend, Campaign, Case, CellRun, Runtime, utcnow
from matrix.errors import ConfigError
from matrix.fanout.shard_results import OUTCOME_FIELDS, ShardAttempt, ShardCampaign, ShardResults, to_utc
from matrix.schedule.scheduler import attempt_log_dir
from matrix.text import clean

IMPORT_EXECUTOR = "import"
_CHUNK = 500  # uids per IN (...) query, well under every database's parameter limit
_HOST_CHARS = 256


@dataclass
class CampaignImport:
    id: int
    key: str
    created: bool
    imported: int = 0
    present: int = 0
    updated: int = 0
    renumbered: int = 0
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Item:
    results: ShardResults
    attempt: ShardAttempt


def _unique_attempts(files: Sequence[ShardResults]) -> list[_Item]:
    """Every attempt once; the same uid in two files must be the same attempt of the same campaign."""
    seen: dict[str, _Item] = {}
    items = []
    for results in files:
        for attempt in sorted(results.attempts, key=lambda a: (a.attempt, a.outcome["started_at"] or _EPOCH, a.uid)):
            first = seen.get(attempt.uid)
            if first is None:
                seen[attempt.uid] = item = _Item(results, attempt)
                items.append(item)
            elif (first.attempt.key, first.results.campaign.key, first.attempt.outcome) != (
                attempt.key, results.campaign.key, attempt.outcome,
            ):  # fmt: skip
                raise ConfigError(
                    f"attempt {attempt.uid} differs between {first.results.path} and {results.path}: "
                    "import files from one shard run only once (a copy of a file is fine)"
                )
    return items


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _resolve_catalog(session: Session, items: Sequence[_Item]) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """Case name -> id and (backend, version) -> runtime id; every missing one is named in one error."""
    cases = {name: (cid, backend) for cid, name, backend in session.execute(
        select(Case.id, Case.name, Backend.name).join(Backend, Case.backend_id == Backend.id))}  # fmt: skip
    runtimes = {(backend, version): rid for rid, backend, version in session.execute(
        select(Runtime.id, Backend.name, Runtime.version).join(Backend, Runtime.backend_id == Backend.id))}  # fmt: skip
    missing: dict[str, list[str]] = {}
    for item in items:
        a = item.attempt
        where = str(item.results.path)
        if a.case not in cases:
            missing.setdefault(f"case {a.case!r}", []).append(where)
        elif cases[a.case][1] != a.backend:
            missing.setdefault(
                f"case {a.case!r} of backend {a.backend!r} (here it is {cases[a.case][1]!r})", []
            ).append(where)
        # A skew attempt's roles ran other runtimes of the backend: each must be in this catalog too.
        for version in {a.runtime_version, *a.roles.values()}:
            if (a.backend, version) not in runtimes:
                missing.setdefault(f"runtime {a.backend}={version}", []).append(where)
    if missing:
        lines = [f"{what} (in {', '.join(sorted(set(paths))[:3])})" for what, paths in sorted(missing.items())]
        raise ConfigError(
            "this database's catalog lacks what the shards ran: " + "; ".join(lines[:20])
            + (f"; and {len(lines) - 20} more" if len(lines) > 20 else "")
            + ". Run `matrix catalog sync` with the catalog files the shards used, then import again; "
            "nothing was imported"
        )  # fmt: skip
    return {name: cid for name, (cid, _) in cases.items()}, runtimes


def _chunks(values: Sequence[str]) -> Iterable[Sequence[str]]:
    for start in range(0, len(values), _CHUNK):
        yield values[start : start + _CHUNK]


def find_campaign(session: Session, key: str) -> Campaign | None:
    """The (oldest) campaign carrying this key."""
    return session.scalar(
        select(Campaign).where(Campaign.selection["campaign_key"].as_string() == key).order_by(Campaign.id).limit(1)
    )


def _check_existing(
    session: Session, items: Sequence[_Item], case_ids: dict[str, int], runtime_ids: dict[tuple[str, str], int]
) -> dict[str, CellRun]:
    """Rows already here by uid; one that is another cell or another campaign's is an error."""
    uids = [item.attempt.uid for item in items]
    existing: dict[str, CellRun] = {}
    for chunk in _chunks(uids):
        for found in session.scalars(select(CellRun).where(CellRun.uid.in_(chunk))):
            existing[found.uid] = found
    for item in items:
        a = item.attempt
        row = existing.get(a.uid)
        if row is None:
            continue
        here_cell = (row.case_id, row.runtime_id, row.roles_key)
        if here_cell != (case_ids[a.case], runtime_ids[(a.backend, a.runtime_version)], a.roles_key):
            raise ConfigError(
                f"{item.results.path}: attempt {a.uid} ({a.key}) is already in this database as another cell "
                f"({row.cell_key}); nothing was imported"
            )
        here = row.campaign.selection.get("campaign_key")
        if here != item.results.campaign.key:
            raise ConfigError(
                f"{item.results.path}: attempt {a.uid} is already in campaign {row.campaign_id} here, whose key is "
                f"{here!r}, not {item.results.campaign.key!r}; nothing was imported"
            )
    return existing


def _merge_hosts(current: str, sources: Iterable[ShardCampaign]) -> str:
    hosts = {h for h in current.split(", ") if h} | {s.host for s in sources if s.host}
    text = ", ".join(sorted(hosts))
    return text if len(text) <= _HOST_CHARS else text[: _HOST_CHARS - 1] + "…"


def _campaign_for(session: Session, key: str, sources: Sequence[ShardCampaign], cells: Iterable[str]) -> CampaignImport:
    campaign = find_campaign(session, key)
    created = campaign is None
    if campaign is None:
        first = sources[0]
        campaign = Campaign(
            status="finished", executor=IMPORT_EXECUTOR, host="", git_sha=first.git_sha,
            matrix_version=first.matrix_version, owner_pid=None,
            selection={k: v for k, v in first.selection.items() if k not in ("cells", "campaign_key")},
            started_at=min((s.started_at for s in sources if s.started_at), default=None) or utcnow(),
        )  # fmt: skip
        session.add(campaign)
    selection = dict(campaign.selection)
    selection["cells"] = sorted(set(selection.get("cells", ())) | set(cells))
    selection["campaign_key"] = key
    if selection != campaign.selection:
        campaign.selection = selection
    if campaign.executor == IMPORT_EXECUTOR:
        # Only an imported campaign's summary is ours to keep; a campaign that ran here keeps its own.
        starts = [t for t in (to_utc(campaign.started_at), *(s.started_at for s in sources)) if t]
        ends = [t for t in (to_utc(campaign.finished_at), *(s.finished_at for s in sources)) if t]
        if starts and to_utc(campaign.started_at) != min(starts):
            campaign.started_at = min(starts)
        if ends and to_utc(campaign.finished_at) != max(ends):
            campaign.finished_at = max(ends)
        if any(s.status != "finished" for s in sources) and campaign.status != "interrupted":
            campaign.status = "interrupted"
        hosts = _merge_hosts(campaign.host, sources)
        if hosts != campaign.host:
            campaign.host = hosts
    session.flush()
    result = CampaignImport(campaign.id, key, created)
    shas = sorted({s.git_sha for s in sources if s.git_sha} | ({campaign.git_sha} if campaign.git_sha else set()))
    if len(shas) > 1:
        result.warnings.append(f"campaign {campaign.id}: shards ran different git commits ({', '.join(shas)})")
    return result


def _write_logs(directory: Path, attempt: ShardAttempt, host: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for role, (tail, size) in attempt.logs.items():
        text = tail
        if size > len(tail.encode("utf-8")):
            text = (
                f"[matrix import: the last part of {role}.log ({size} bytes) as {host or 'the runner'} had it in "
                f"{clean(attempt.source_log_dir)}]\n{tail}"
            )
        (directory / f"{role}.log").write_text(text, encoding="utf-8")


def _same_outcome(row: CellRun, attempt: ShardAttempt) -> bool:
    for name in OUTCOME_FIELDS:
        value = getattr(row, name)
        if name in ("started_at", "finished_at"):
            value = to_utc(value)
        if value != attempt.outcome[name]:
            return False
    return True


def import_results(session: Session, files: Sequence[ShardResults], logs_root: Path) -> list[CampaignImport]:
    """Merge every file in the caller's transaction; validate all before writing anything."""
    items = _unique_attempts(files)
    case_ids, runtime_ids = _resolve_catalog(session, items)
    existing = _check_existing(session, items, case_ids, runtime_ids)

    keys: dict[str, list[ShardResults]] = {}
    for results in files:
        keys.setdefault(results.campaign.key, []).append(results)
    summaries = []
    for key, group in keys.items():
        cells = {a.key for r in group for a in r.attempts}
        cells |= {c for r in group for c in r.campaign.selection.get("cells", ()) if isinstance(c, str)}
        summary = _campaign_for(session, key, [r.campaign for r in group], cells)
        # Attempt numbers per cell (case, runtime, roles key): a skew pair shares decode's runtime id.
        taken: dict[tuple[int, int, str], set[int]] = {}
        for case_id, runtime_id, roles, number in session.execute(
            select(CellRun.case_id, CellRun.runtime_id, CellRun.roles_key, CellRun.attempt).where(
                CellRun.campaign_id == summary.id
            )
        ):
            taken.setdefault((case_id, runtime_id, roles), set()).add(number)
        for item in items:
            if item.results.campaign.key != key:
                continue
            a = item.attempt
            row = existing.get(a.uid)
            if row is not None:
                if _same_outcome(row, a):
                    summary.present += 1
                else:
                    for name in OUTCOME_FIELDS:
                        setattr(row, name, a.outcome[name])
                    summary.updated += 1
                continue
            cell = (case_ids[a.case], runtime_ids[(a.backend, a.runtime_version)], a.roles_key)
            numbers = taken.setdefault(cell, set())
            number = a.attempt
            if number in numbers:
                number = max(numbers) + 1
                summary.renumbered += 1
            numbers.add(number)
            # Only what the shard carried is ever read for this attempt: its source host's log directory
            # names a place on another machine (or anything at all), so it is never kept as the log dir.
            log_dir = ""
            if a.logs:
                directory = attempt_log_dir(logs_root / f"campaign-{summary.id}", a.key, a.uid)
                _write_logs(directory, a, a.outcome["owner_host"])
                log_dir = str(directory)
            session.add(
                CellRun(
                    uid=a.uid, campaign_id=summary.id, case_id=cell[0], runtime_id=cell[1], roles=dict(a.roles),
                    roles_key=a.roles_key, attempt=number,
                    owner_pid=None, heartbeat_at=None, log_dir=log_dir, **a.outcome,
                )
            )  # fmt: skip
            summary.imported += 1
        summaries.append(summary)
    session.flush()
    return summaries
