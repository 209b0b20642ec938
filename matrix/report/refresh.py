"""What a report refresh after `matrix run` may leave as it is ([M33] item 3).

A full report reads and writes everything: at a year of nightlies that is thousands of pages, while a run of
ten cells changes a handful (its runtimes' pages, its campaign's, the gates and the comparison that read
those runtimes, the index). The full write leaves `STATE_FILE` beside the index: a fingerprint of every input
a page depends on *besides the attempts* (the catalog's runtimes, cases, gate policies and waivers, the date
that waivers expire against, matrix's version and its templates) and the gate badges and comparison links the
index shows. A refresh whose fingerprint matches rewrites only what the new campaigns' attempts reach and
takes the rest of the index from the state; any other change (a `catalog sync`, a waiver, a new day, a new
matrix) makes the refresh a full write. A report written for a selection has no state: a refresh never
builds on it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix import __version__
from matrix.db.models import GatePolicy, Quarantine, Waiver
from matrix.paths import staging_path
from matrix.report.data import Results
from matrix.report.views import GateBadge
from matrix.resources import resource_dir

__all__ = ["STATE_FILE", "ReportState", "fingerprint", "reached", "read_state", "remove_state", "write_state"]

STATE_FILE = ".report-state.json"
_FORMAT = 1


@dataclass(frozen=True)
class ReportState:
    fingerprint: str
    # runtime id -> its badges under every policy, as the index shows them
    badges: Mapping[int, tuple[GateBadge, ...]]
    # backend -> its comparison's link on the index ({"href", "title", "counts"})
    comparisons: Mapping[str, Mapping[str, Any]]


def fingerprint(session: Session, results: Results, today: dt.date) -> str:
    """A digest of every input of the report except the attempts themselves."""
    digest = hashlib.sha256()
    for part in (_FORMAT, __version__, today.isoformat()):
        digest.update(f"{part}\n".encode())
    for view in (*results.runtimes, *results.cases):
        digest.update(repr(view).encode())
    for model in (GatePolicy, Waiver, Quarantine):  # a quarantine mutes cells of a gate
        for row in session.execute(select(model).order_by(model.id)).scalars():
            digest.update(repr(_columns(row)).encode())
    templates = resource_dir("templates")
    for path in sorted(templates.glob("*.html")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _columns(row: Any) -> tuple[Any, ...]:
    return tuple(getattr(row, column.key) for column in row.__table__.columns)


def read_state(out_dir: Path) -> ReportState | None:
    """The state a full write left in `out_dir`, or None (none, unreadable or of another format)."""
    try:
        raw = json.loads((out_dir / STATE_FILE).read_text(encoding="utf-8"))
        if raw.get("format") != _FORMAT or not (out_dir / "index.html").is_file():
            return None
        badges = {int(k): tuple(GateBadge(*b) for b in v) for k, v in raw["badges"].items()}
        return ReportState(str(raw["fingerprint"]), badges, dict(raw["comparisons"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_state(out_dir: Path, state: ReportState) -> None:
    raw = {
        "format": _FORMAT,
        "fingerprint": state.fingerprint,
        "badges": {str(k): [list(b) for b in v] for k, v in state.badges.items()},
        "comparisons": state.comparisons,
    }
    staging = staging_path(out_dir / STATE_FILE)  # two runners of one campaign may refresh one report at once
    try:
        staging.write_text(json.dumps(raw), encoding="utf-8")
        staging.replace(out_dir / STATE_FILE)  # never half a state: a reader falls back to a full write
    finally:
        staging.unlink(missing_ok=True)


def remove_state(out_dir: Path) -> None:
    (out_dir / STATE_FILE).unlink(missing_ok=True)


def reached(results: Results, campaigns: Sequence[int]) -> set[int]:
    """The runtime ids that have attempts in `campaigns`."""
    wanted = set(campaigns)
    return {a.runtime_id for a in results.attempts() if a.campaign_id in wanted}
