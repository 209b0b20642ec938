"""`matrix export json`: the cells in scope with their latest attempts, and the version-skew grids of the
cases in scope, for scripts and dashboards.

Text that came from processes (messages, check messages, completions) is redacted like in the pages;
worker ids stay decimal strings so no JSON reader rounds a u64.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

from sqlalchemy.orm import Session

from matrix.outcome import STORED_COLUMNS, standing_attempt
from matrix.report.data import AttemptDetail, ResultCell, Results, load_details
from matrix.report.skew import skew_grids
from matrix.report.stats import pass_rate
from matrix.text import clean

__all__ = ["export_json", "iter_cell_dicts"]


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat(timespec="seconds") if value else None


def _exported(name: str, value: Any) -> Any:
    """A stored column as JSON: text that came from processes redacted, JSON columns as plain dicts."""
    if name in ("message", "completion_excerpt"):
        return clean(value)
    if name == "checks":
        return [{"name": clean(str(c.get("name", ""))), "message": clean(str(c.get("message", "")))} for c in value]
    if STORED_COLUMNS[name] == (dict,):
        return dict(value)
    return value


def attempt_dict(a: AttemptDetail) -> dict[str, Any]:
    """One attempt: its identity, when it ran, every stored column of its outcome (`STORED_COLUMNS`), its logs."""
    return {
        "id": a.uid,
        "campaign": a.campaign_id,
        "attempt": a.attempt,
        "started_at": _iso(a.started_at),
        "finished_at": _iso(a.finished_at),
        **{name: _exported(name, getattr(a, name)) for name in STORED_COLUMNS},
        "log_dir": a.log_dir,
    }


def _cell_dict(cell: ResultCell, attempts: list[AttemptDetail]) -> dict[str, Any]:
    last = standing_attempt(attempts)
    return {
        "cell": cell.key,
        "case": cell.case.name,
        "backend": cell.runtime.backend,
        "version": cell.runtime.version,
        "status": last.status if last else None,
        "attempts": len(attempts),
        # Every informative attempt in scope: passes and the cell's own failures, Wilson 95 % interval.
        "pass_rate": pass_rate([a.status for a in attempts]).as_dict(),
        "missing_fixes": [clean(why) for why in cell.missing],
        "latest": attempt_dict(last) if last else None,
    }


def iter_cell_dicts(session: Session, results: Results) -> Iterator[dict[str, Any]]:
    """One dict per cell, runtime by runtime (one query per runtime)."""
    for runtime in results.runtimes:
        cells = results.cells_of_runtime(runtime.id)
        details = load_details(
            session, runtime.id, case_ids=[c.case.id for c in cells], campaign_id=results.campaign_id
        )
        for cell in cells:
            yield _cell_dict(cell, details.get(cell.case.id, []))


def export_json(session: Session, results: Results) -> dict[str, Any]:
    """The whole export as one JSON-ready dict."""
    return {
        "generated_at": _iso(dt.datetime.now(dt.UTC)),
        "campaign": results.campaign_id,
        "selection": results.selection.as_dict() if results.selection else None,
        "runtimes": [
            {"backend": r.backend, "version": r.version, "tag": r.tag, "channel": r.channel,
             "components": dict(r.components), "retired": r.retired}
            for r in results.runtimes
        ],
        "cells": list(iter_cell_dicts(session, results)),
        # Version-skew grids of the cases in scope: each (frontend, prefill, decode) cell's latest attempt and
        # outcome class (`matrix skew CASE --json` has the same shape per case).
        "skew": [grid.as_dict() for grid in skew_grids(session, [c.name for c in results.cases],
                                                       results.campaign_id)],
    }  # fmt: skip
