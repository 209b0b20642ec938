"""The shard results file: what `matrix run --results-out` writes and `matrix import` reads.

One JSON object per file: the format and its version, the writing matrix's version, the campaign
(key, selection, host, git sha, start and end) and every attempt of the campaign with natural keys
(case, backend, runtime version, a skew cell's version per role, attempt, uid) instead of database ids, so
another database can take them in. Each attempt carries the tail of each of its role logs (bounded, so a
shard of many cells stays a small artifact) so that `matrix show` and the report still have something to
show after import.

Reading validates everything (types of every field, known statuses) and names the file and the entry
at fault; the importer writes nothing unless every file is valid.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from matrix import __version__
from matrix.cells import ROLES, cell_id, roles_key, skew_cell_key
from matrix.db.models import Campaign, CellRun, Runtime
from matrix.errors import ConfigError
from matrix.fanout.shards import check_campaign_key
from matrix.outcome import FINISHED_STATUSES, PASSED, SKIPPED, STORED_COLUMNS
from matrix.text import clean, clean_data, completion_excerpt, excerpt

FORMAT = "matrix-shard-results"
FORMAT_VERSION = 1
# Version 2 adds each attempt's `roles` ({role: version} of a skew cell). A file with no skew attempt is still
# written as version 1, which every matrix reads; one with skew attempts is version 2, so that an older
# matrix refuses it instead of importing a prefill=A/decode=B attempt as the diagonal cell of B.
FORMAT_VERSION_ROLES = 2
READ_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_ROLES)
# Bounds on carried logs: the last 16 KiB of each role log of an attempt that did not pass (where the
# cause is), 4 KiB of one that passed or was skipped, at most 8 logs per attempt.
LOG_TAIL_BYTES = 16 * 1024
LOG_TAIL_BYTES_OK = 4 * 1024
MAX_LOGS_PER_ATTEMPT = 8

_NONE = type(None)
# Every outcome column of `cell_run` that travels (`matrix.outcome.STORED_COLUMNS`, when and where it ran
# after the verdict), with the JSON types it may have. Database ids, heartbeats and runner pids stay
# behind: they mean nothing in another database.
_ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "started_at": (str, _NONE), "finished_at": (str, _NONE), "owner_host": (str,)
}  # fmt: skip
_HEAD = ("status", "failure_kind", "message", "checks", "expected_failure", "unexpected_pass", "flaky")
OUTCOME_FIELDS: dict[str, tuple[type, ...]] = {
    **{name: STORED_COLUMNS[name] for name in _HEAD},
    **_ROW_FIELDS,
    **{name: types for name, types in STORED_COLUMNS.items() if name not in _HEAD},
}
_TIME_FIELDS = ("started_at", "finished_at")
_UID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CELL_FIELDS: dict[str, tuple[type, ...]] = {
    "case": (str,),
    "backend": (str,),
    "runtime_version": (str,),
    "attempt": (int,),
    "uid": (str,),
    "source_log_dir": (str,),
    "logs": (dict,),
    **OUTCOME_FIELDS,
}
_CAMPAIGN_FIELDS: dict[str, tuple[type, ...]] = {
    "key": (str,),
    "status": (str,),
    "selection": (dict,),
    "host": (str,),
    "executor": (str,),
    "git_sha": (str,),
    "matrix_version": (str,),
    "started_at": (str, _NONE),
    "finished_at": (str, _NONE),
}


# Outcome fields that hold text a process produced: cleaned (redacted, printable) on the way out and in.
_TEXT_FIELDS = ("message", "expected_failure", "owner_host")


def clean_outcome_text(outcome: Mapping[str, Any]) -> dict[str, Any]:
    """The free-text fields of an outcome (message, checks, completion...) redacted and printable."""
    cleaned: dict[str, Any] = {name: clean(outcome[name]) for name in _TEXT_FIELDS if isinstance(outcome[name], str)}
    if isinstance(outcome["completion_excerpt"], str):
        cleaned["completion_excerpt"] = completion_excerpt(outcome["completion_excerpt"])  # redacted, then cut
    cleaned["checks"] = clean_data(outcome["checks"])
    for name in ("finish_reason", "failure_kind"):
        if isinstance(outcome[name], str):
            cleaned[name] = clean(outcome[name])[:32]
    cleaned["components"] = clean_data(outcome["components"])
    return cleaned


def to_utc(value: dt.datetime | None) -> dt.datetime | None:
    """SQLite hands back naive datetimes that were written as UTC; make every value aware UTC."""
    if value is None:
        return None
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def _iso(value: dt.datetime | None) -> str | None:
    aware = to_utc(value)
    return aware.isoformat() if aware else None


# --- writing ------------------------------------------------------------------------------------------------


def log_tails(log_dir: str, limit: int = LOG_TAIL_BYTES) -> dict[str, dict[str, Any]]:
    """role -> {"tail": the last `limit` bytes of the log (from a line start), "bytes": its full size}."""
    directory = Path(log_dir) if log_dir else None
    if directory is None or not directory.is_dir():
        return {}
    tails: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in directory.glob("*.log") if p.is_file())[:MAX_LOGS_PER_ATTEMPT]:
        size = path.stat().st_size
        with path.open("rb") as fh:
            fh.seek(max(0, size - limit))
            data = fh.read(limit)
        if size > limit and b"\n" in data:
            data = data[data.index(b"\n") + 1 :]  # start at a whole line
        # Redacted and printable: the file is a CI artifact, readable by whoever reads the run.
        tails[path.stem] = {"tail": clean(data.decode("utf-8", errors="replace")), "bytes": size}
    return tails


def _cell_entry(row: CellRun) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "cell": row.cell_key,
        "cell_id": cell_id(row.cell_key),
        "case": row.case.name,
        "backend": row.runtime.backend.name,
        "runtime_version": row.runtime.version,
        "roles": dict(row.roles or {}),
        "attempt": row.attempt,
        "uid": row.uid,
    }
    for name in OUTCOME_FIELDS:
        value = getattr(row, name)
        entry[name] = _iso(value) if name in _TIME_FIELDS else value
    entry.update(clean_outcome_text(entry))  # rows stored before redaction existed are cleaned here
    entry["source_log_dir"] = row.log_dir
    entry["logs"] = log_tails(row.log_dir, LOG_TAIL_BYTES_OK if row.status in (PASSED, SKIPPED) else LOG_TAIL_BYTES)
    return entry


def results_document(session: Session, campaign_id: int, key: str) -> dict[str, Any]:
    campaign = session.get_one(Campaign, campaign_id)
    rows = session.scalars(
        select(CellRun)
        # Only finished attempts travel: an interrupted shard leaves `pending` rows (never started) that
        # mean nothing elsewhere; the campaign's `cells` still lists them as planned.
        .where(CellRun.campaign_id == campaign_id, CellRun.status.in_(FINISHED_STATUSES))
        .options(selectinload(CellRun.case), selectinload(CellRun.runtime).selectinload(Runtime.backend))
        .order_by(CellRun.id)
    ).all()
    cells = [_cell_entry(row) for row in rows]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION_ROLES if any(c["roles"] for c in cells) else FORMAT_VERSION,
        "matrix_version": __version__,
        "campaign": {
            "key": campaign.selection.get("campaign_key") or key,
            "id": campaign.id,
            "status": campaign.status,
            "selection": dict(campaign.selection),
            "host": campaign.host,
            "executor": campaign.executor,
            "git_sha": campaign.git_sha,
            "matrix_version": campaign.matrix_version,
            "started_at": _iso(campaign.started_at),
            "finished_at": _iso(campaign.finished_at),
        },
        "cells": cells,
    }


def write_results(session: Session, campaign_id: int, path: Path, key: str) -> int:
    """Write the campaign's attempts to `path` atomically (a reader never sees half a file); returns the count."""
    document = results_document(session, campaign_id, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A sibling temporary file (same file system, so the rename is atomic), created with the umask's mode.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as fh:
            json.dump(document, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(document["cells"])


# --- reading ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardCampaign:
    key: str
    status: str
    selection: Mapping[str, Any]
    host: str
    executor: str
    git_sha: str
    matrix_version: str
    started_at: dt.datetime | None
    finished_at: dt.datetime | None


@dataclass(frozen=True)
class ShardAttempt:
    case: str
    backend: str
    runtime_version: str
    attempt: int
    uid: str
    outcome: Mapping[str, Any]  # OUTCOME_FIELDS, times as aware datetimes
    source_log_dir: str
    logs: Mapping[str, tuple[str, int]]  # role -> (tail text, size of the whole log in bytes)
    # A skew cell's {role: version} (`matrix.cells.roles_key`); {} for a diagonal cell and in version 1 files.
    roles: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return skew_cell_key(self.case, self.backend, self.runtime_version, self.roles)

    @property
    def roles_key(self) -> str:
        return roles_key(self.roles)


@dataclass(frozen=True)
class ShardResults:
    path: Path
    campaign: ShardCampaign
    attempts: tuple[ShardAttempt, ...]


def _fail(path: Path, what: str) -> ConfigError:
    return ConfigError(
        f"{path}: {what}. Nothing was imported; use the file exactly as `matrix run --results-out` wrote it "
        "(re-download the artifact, or re-run the shard)"
    )


def _check_fields(path: Path, where: str, data: Any, fields: Mapping[str, tuple[type, ...]]) -> None:
    if not isinstance(data, dict):
        raise _fail(path, f"{where} must be a JSON object, got {type(data).__name__}")
    for name, types in fields.items():
        if name not in data:
            raise _fail(path, f"{where} lacks {name!r}")
        value = data[name]
        accepted = types + ((int,) if float in types else ())  # JSON writes 2.0 as 2 in some encoders
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, accepted):
            names = " or ".join("null" if t is _NONE else t.__name__ for t in types)
            raise _fail(path, f"{where}: {name!r} must be {names}, got {excerpt(json.dumps(value), 80)}")


def _time(path: Path, where: str, value: str | None) -> dt.datetime | None:
    if value is None:
        return None
    try:
        return to_utc(dt.datetime.fromisoformat(value))
    except ValueError:
        raise _fail(path, f"{where}: {value!r} is not an ISO 8601 time") from None


# Outcome fields added after format version 1 was fixed, with what a shard written before them means.
ADDED_FIELDS: Mapping[str, Any] = {"kv_ledger": {}, "listeners": []}  # not recorded then: "not measured"


def _attempt(path: Path, index: int, data: Any) -> ShardAttempt:
    where = f"cells[{index}]"
    if isinstance(data, dict):
        data = {**{name: type(value)(value) for name, value in ADDED_FIELDS.items()}, **data}
    _check_fields(path, where, data, _CELL_FIELDS)
    where = f"cells[{index}] ({data['case']}@{data['backend']}-{data['runtime_version']}, {data['uid']})"
    if data["status"] not in FINISHED_STATUSES:
        raise _fail(
            path, f"{where}: status {data['status']!r} is not a finished status "
            f"({', '.join(sorted(FINISHED_STATUSES))})",
        )  # fmt: skip
    if data["attempt"] < 1 or not _UID.fullmatch(data["uid"]):
        # The uid names the attempt's log directory on import: never let it be a path.
        raise _fail(path, f"{where}: attempt must be 1 or more and uid 1-64 letters, digits, '_' or '-'")
    outcome = {name: data[name] for name in OUTCOME_FIELDS}
    for name in _TIME_FIELDS:
        outcome[name] = _time(path, f"{where} {name}", data[name])
    for name, types in OUTCOME_FIELDS.items():
        if float in types and isinstance(outcome[name], int):
            outcome[name] = float(outcome[name])
    # A shard from another host (or an older matrix) is redacted before anything of it is stored.
    outcome.update(clean_outcome_text(outcome))
    logs: dict[str, tuple[str, int]] = {}
    for role, log in data["logs"].items():
        if not isinstance(log, dict) or not isinstance(log.get("tail"), str) or type(log.get("bytes")) is not int:
            raise _fail(path, f"{where}: logs[{role!r}] must be an object with a string 'tail' and an int 'bytes'")
        if not role or "/" in role or "\\" in role or role.startswith(".") or not role.isprintable():
            raise _fail(path, f"{where}: log name {role!r} is not a plain file name")
        logs[role] = (clean(log["tail"]), log["bytes"])
    return ShardAttempt(
        data["case"], data["backend"], data["runtime_version"], data["attempt"], data["uid"], outcome,
        data["source_log_dir"], logs, _roles(path, where, data.get("roles", {})),
    )  # fmt: skip


def _roles(path: Path, where: str, roles: Any) -> dict[str, str]:
    """A skew attempt's {role: version}: known roles, each a version string, in ROLES order."""
    if not isinstance(roles, dict) or any(r not in ROLES or not isinstance(v, str) or not v for r, v in roles.items()):
        raise _fail(path, f"{where}: roles must map {', '.join(ROLES)} to version strings, got "
                    f"{excerpt(json.dumps(roles), 80)}")  # fmt: skip
    return {role: roles[role] for role in ROLES if role in roles}


def parse_results(path: Path, text: str) -> ShardResults:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        # One sentence: _fail appends ". Nothing was imported; ...", which read badly after "truncated?".
        where = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        raise _fail(path, f"not valid JSON, perhaps cut short ({where})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(path, f'not a matrix shard results file (expected "format": "{FORMAT}")')
    version = data.get("format_version")
    if version not in READ_VERSIONS:
        raise ConfigError(
            f"{path}: format_version {version!r} is not supported; this matrix ({__version__}) reads versions "
            f"{' and '.join(map(str, READ_VERSIONS))}. Import with the matrix version that ran the shards (the "
            f"file says {data.get('matrix_version')!r})"
        )
    _check_fields(path, "campaign", data.get("campaign"), _CAMPAIGN_FIELDS)
    raw = data["campaign"]
    try:
        key = check_campaign_key(raw["key"])
    except ConfigError as exc:
        raise _fail(path, f"campaign: {exc}") from None
    campaign = ShardCampaign(
        key, raw["status"], raw["selection"], raw["host"], raw["executor"], raw["git_sha"], raw["matrix_version"],
        _time(path, "campaign started_at", raw["started_at"]), _time(path, "campaign finished_at", raw["finished_at"]),
    )  # fmt: skip
    cells = data.get("cells")
    if not isinstance(cells, list):
        raise _fail(path, "'cells' must be a list")
    attempts = tuple(_attempt(path, i, entry) for i, entry in enumerate(cells))
    if version == FORMAT_VERSION and any(a.roles for a in attempts):
        raise _fail(path, "a version 1 file cannot carry skew attempts (roles); version 2 does")
    seen: dict[str, ShardAttempt] = {}
    for attempt in attempts:
        if attempt.uid in seen:
            raise _fail(path, f"uid {attempt.uid} appears twice")
        seen[attempt.uid] = attempt
    return ShardResults(path, campaign, attempts)


def read_results(path: Path) -> ShardResults:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc}); give the path of a file `--results-out` wrote") from None
    return parse_results(path, text)
