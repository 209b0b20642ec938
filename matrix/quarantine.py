"""Quarantine ([M30] item 3): mute a cell, by hand or on flake evidence, and record every entry and exit.

A quarantined cell still runs and is recorded; the gate lists it as muted and does not block on its failures
(`matrix.report.muted`, rule 9 of `matrix.report.gate`). A quarantine row is never deleted: its exit is
written into it, so `matrix quarantines --all` is the whole record of who muted what, why and how it ended.

* Manual entry: `matrix quarantine CASE [--runtime B=V] --owner O --until DAY --reason R` (every runtime of the
  case without `--runtime`). Manual exit: `matrix unquarantine CASE [--runtime B=V] --reason R`.
* Automatic entry (`matrix run --auto-quarantine`): a cell tuple (case, runtime, roles) that failed in the
  run, and also passed within the window (`--quarantine-window-days`, default 7) before or after, is muted,
  the uids of that pass and that failure kept as its evidence. Only a failure newer than the tuple's last
  automatic exit counts: old evidence never re-enters a cell. The owner is the one the catalog names for the
  case (the owner of a waiver of the case in force), else `unowned`.
* Automatic exit, after every run: an automatic quarantine whose cell's latest `--quarantine-clean-runs`
  (default 3) informative attempts after its evidence all passed exits (`clean-runs`, their uids kept); any
  quarantine whose `until` day has passed exits (`expired`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Backend, Case, CellRun, Quarantine, Runtime, Waiver
from matrix.errors import ConfigError
from matrix.outcome import CELL_FAULT_STATUSES, PASSED
from matrix.text import clean
from matrix.versions import parse_specifier, parse_version, specifier_admits

__all__ = ["AutoRule", "enter", "parse_until", "release", "update_after_run"]

DEFAULT_WINDOW_DAYS = 7
DEFAULT_CLEAN_RUNS = 3
UNOWNED = "unowned"
# A longer owner or reason is refused: they are names and one-line reasons, shown in tables and on the gate.
MAX_TEXT = 500


@dataclass(frozen=True)
class AutoRule:
    """Automatic entry: flake evidence within `window_days`; automatic exit after `clean_runs` passes."""

    window_days: int = DEFAULT_WINDOW_DAYS
    clean_runs: int = DEFAULT_CLEAN_RUNS


def parse_until(text: str, today: dt.date) -> dt.date:
    """`--until`: a day (YYYY-MM-DD), today or later."""
    try:
        day = dt.date.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"--until {text!r} is not a date: write YYYY-MM-DD, e.g. {today.isoformat()}") from None
    if day < today:
        raise ConfigError(f"--until {day.isoformat()} is in the past (today is {today.isoformat()} UTC): give today "
                          "or a later day")  # fmt: skip
    return day


def _text(value: str, option: str) -> str:
    found = value.strip()
    if not found:
        raise ConfigError(f"{option} is empty: name who answers for the muted cell and why")
    if len(found) > MAX_TEXT or "\n" in found or "\r" in found:
        raise ConfigError(f"{option} must be one line of at most {MAX_TEXT} characters")
    return found


def _case(session: Session, name: str) -> Case:
    case = session.scalar(select(Case).where(Case.name == name, Case.retired.is_(False)))
    if case is None:
        raise ConfigError(f"unknown case {clean(name)!r}: `matrix cases list` shows the case names")
    return case


def _runtime(session: Session, case: Case, spec: str | None) -> Runtime | None:
    if spec is None:
        return None
    backend, _, version = spec.partition("=")
    if not backend.strip() or not version.strip():
        raise ConfigError(f"--runtime {clean(spec)!r}: write BACKEND=VERSION, e.g. reference=0.1.0")
    wanted = parse_version(version.strip())
    rows = session.scalars(
        select(Runtime).join(Backend, Runtime.backend_id == Backend.id).where(
            Backend.name == backend.strip().lower(), Runtime.retired.is_(False))
    )  # fmt: skip
    runtime = next((r for r in rows if parse_version(r.version) == wanted), None)
    if runtime is None:
        raise ConfigError(f"--runtime {clean(spec)!r}: no such runtime (`matrix runtimes list` shows them)")
    if runtime.backend_id != case.backend_id:
        raise ConfigError(f"--runtime {clean(spec)!r} is not a runtime of case {case.name}'s backend "
                          f"{case.backend.name}")  # fmt: skip
    return runtime


def _current(session: Session, case_id: int) -> list[Quarantine]:
    return list(
        session.scalars(
            select(Quarantine)
            .where(Quarantine.case_id == case_id, Quarantine.exited_at.is_(None))
            .order_by(Quarantine.id)
        )
    )


def enter(
    session: Session, case_name: str, runtime_spec: str | None, owner: str, until: dt.date, reason: str,
    now: dt.datetime,
) -> Quarantine:  # fmt: skip
    """A manual quarantine; every input checked before anything is written (`ConfigError`: exit 2)."""
    case = _case(session, case_name)
    runtime = _runtime(session, case, runtime_spec)
    owner, reason = _text(owner, "--owner"), _text(reason, "--reason")
    runtime_id = runtime.id if runtime is not None else None
    for row in _current(session, case.id):
        if row.runtime_id == runtime_id and row.roles_key == "":
            raise ConfigError(f"{case.name} is already quarantined there (owner {clean(row.owner)}, {row.entry}): "
                              "`matrix unquarantine` it first to change it")  # fmt: skip
    row = Quarantine(case=case, runtime=runtime, roles_key="", owner=owner, reason=reason, until=until,
                     entry="manual", evidence=[], clean_runs=None, entered_at=now, exit_reason="",
                     exit_evidence=[])  # fmt: skip
    session.add(row)
    session.flush()
    return row


def release(
    session: Session, case_name: str, runtime_spec: str | None, reason: str, now: dt.datetime
) -> list[Quarantine]:
    """End the quarantines in force of the case (of that runtime with `runtime_spec`, else every one)."""
    case = _case(session, case_name)
    runtime = _runtime(session, case, runtime_spec)
    reason = _text(reason, "--reason")
    rows = [r for r in _current(session, case.id) if runtime is None or r.runtime_id == runtime.id]
    if not rows:
        where = f" on {runtime.backend.name}-{runtime.version}" if runtime is not None else ""
        raise ConfigError(f"{case.name} is not quarantined{where}: `matrix quarantines` lists what is")
    for row in rows:
        _exit(row, "manual", reason, [], now)
    return rows


def _exit(row: Quarantine, how: str, reason: str, evidence: Sequence[str], now: dt.datetime) -> None:
    row.exited_at, row.exit, row.exit_reason, row.exit_evidence = now, how, reason, list(evidence)


@dataclass(frozen=True)
class _Attempt:
    id: int
    uid: str
    campaign_id: int
    status: str
    finished_at: dt.datetime | None


def _attempts(session: Session, case_id: int, runtime_id: int, roles_key: str) -> list[_Attempt]:
    """The tuple's informative attempts (a pass or a failure of the cell's own), oldest first."""
    stmt = (
        select(CellRun.id, CellRun.uid, CellRun.campaign_id, CellRun.status, CellRun.finished_at)
        .where(CellRun.case_id == case_id, CellRun.runtime_id == runtime_id, CellRun.roles_key == roles_key,
               CellRun.status.in_((PASSED, *CELL_FAULT_STATUSES)))
        .order_by(CellRun.id)
    )  # fmt: skip
    return [_Attempt(*row) for row in session.execute(stmt)]


def update_after_run(
    session: Session, campaign_ids: Iterable[int], auto: AutoRule | None, now: dt.datetime
) -> list[str]:
    """Record the exits (expired, clean runs) and, with `auto`, the automatic entries the run's campaigns
    call for; one line per event for the terminal."""
    lines: list[str] = []
    today = now.date()
    current = list(session.scalars(select(Quarantine).where(Quarantine.exited_at.is_(None)).order_by(Quarantine.id)))
    for row in current:
        if row.until is not None and today > row.until:
            _exit(row, "expired", f"until {row.until.isoformat()} passed", [], now)
            lines.append(f"quarantine: {_label(row)} exited: until {row.until.isoformat()} passed")
            continue
        if row.clean_runs is None or row.runtime_id is None:
            continue
        attempts = _attempts(session, row.case_id, row.runtime_id, row.roles_key)
        after = _newest_id(session, row.evidence)
        trailing: list[_Attempt] = []
        for attempt in reversed([a for a in attempts if a.id > after]):
            if attempt.status != PASSED:
                break
            trailing.append(attempt)
        if len(trailing) >= row.clean_runs:
            clean_uids = [a.uid for a in reversed(trailing[: row.clean_runs])]
            _exit(row, "clean-runs", f"{row.clean_runs} clean runs in a row after entry", clean_uids, now)
            uids = ", ".join(clean_uids)
            lines.append(f"quarantine: {_label(row)} exited after {row.clean_runs} clean runs ({uids})")
    if auto is not None:
        lines += _auto_enter(session, sorted(set(campaign_ids)), auto, now)
    session.flush()
    return lines


def _auto_enter(session: Session, campaign_ids: list[int], auto: AutoRule, now: dt.datetime) -> list[str]:
    if not campaign_ids:
        return []
    failed = session.execute(
        select(CellRun.case_id, CellRun.runtime_id, CellRun.roles_key)
        .where(CellRun.campaign_id.in_(campaign_ids), CellRun.status.in_(tuple(CELL_FAULT_STATUSES)))
        .distinct()
    ).all()  # fmt: skip
    lines = []
    since = now - dt.timedelta(days=auto.window_days)
    for case_id, runtime_id, roles_key in sorted(failed):
        # Two runners of one campaign (`--join`) end at once: on PostgreSQL the case's row lock makes the second
        # read the first one's entry (SQLite has one writer at a time anyway).
        session.execute(select(Case.id).where(Case.id == case_id).with_for_update())
        rows = list(session.scalars(select(Quarantine).where(Quarantine.case_id == case_id)))
        if any(r.exited_at is None and r.runtime_id in (None, runtime_id) and r.roles_key == roles_key
               and (r.until is None or now.date() <= r.until) for r in rows):  # fmt: skip
            continue  # already muted
        # Evidence an earlier automatic quarantine of the tuple was released on never re-enters it.
        released = max((_newest_id(session, r.exit_evidence) for r in rows
                        if r.runtime_id == runtime_id and r.roles_key == roles_key), default=0)  # fmt: skip
        window = [a for a in _attempts(session, case_id, runtime_id, roles_key)
                  if a.finished_at is not None and _aware(a.finished_at) >= since]  # fmt: skip
        failure = next((a for a in reversed(window) if a.status != PASSED and a.campaign_id in campaign_ids
                        and a.id > released), None)  # fmt: skip
        passed = next((a for a in reversed(window) if a.status == PASSED), None)
        if failure is None or passed is None:
            continue
        case = session.get(Case, case_id)
        runtime = session.get(Runtime, runtime_id)
        if case is None or runtime is None:  # pragma: no cover - foreign keys hold them
            continue
        reason = (f"flaky: passed in {passed.uid} (campaign {passed.campaign_id}) and {failure.status} in "
                  f"{failure.uid} (campaign {failure.campaign_id}) within {auto.window_days} day(s)")  # fmt: skip
        owner = _case_owner(session, case, runtime, now)
        row = Quarantine(case=case, runtime=runtime, roles_key=roles_key, owner=owner, reason=reason, until=None,
                         entry="automatic", evidence=[passed.uid, failure.uid],
                         clean_runs=auto.clean_runs, entered_at=now, exit_reason="", exit_evidence=[])  # fmt: skip
        session.add(row)
        lines.append(f"quarantine: {_label(row)} entered (automatic, owner {clean(row.owner)}): {reason}")
    return lines


def _case_owner(session: Session, case: Case, runtime: Runtime, now: dt.datetime) -> str:
    """The owner the catalog names for the case: that of a waiver of it in force for the runtime, else unowned."""
    for waiver in session.scalars(select(Waiver).where(Waiver.case_id == case.id, Waiver.retired.is_(False),
                                                       Waiver.owner != "").order_by(Waiver.id)):  # fmt: skip
        admits = not waiver.runtime_spec or specifier_admits(parse_specifier(waiver.runtime_spec),
                                                             parse_version(runtime.version))  # fmt: skip
        if admits and (waiver.expires is None or now.date() <= waiver.expires):
            return waiver.owner
    return UNOWNED


def _newest_id(session: Session, uids: Iterable[object]) -> int:
    wanted = [str(u) for u in uids or ()]
    if not wanted:
        return 0
    return max(session.scalars(select(CellRun.id).where(CellRun.uid.in_(wanted))), default=0)


def _label(row: Quarantine) -> str:
    runtime = f"{row.runtime.backend.name}-{row.runtime.version}" if row.runtime is not None else "every runtime"
    return f"{row.case.name}@{runtime}" + (f"[{row.roles_key}]" if row.roles_key else "")


def _aware(moment: dt.datetime) -> dt.datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
