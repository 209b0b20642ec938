"""Write a cell's outcome onto its `cell_run` row: the record stage's one writer (the readers are in
`matrix/results_read.py`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from matrix.db.models import CellRun, utcnow
from matrix.outcome import STORED_COLUMNS, CellOutcome
from matrix.text import clean_data, completion_excerpt, store_text


def _u64(value: int | None) -> str | None:
    # Worker ids are unsigned 64-bit; stored as decimal text so values above 2**63 - 1 survive any database.
    return None if value is None else str(value)


# How a field of the outcome becomes its column where a plain copy will not do. Text a process produced is
# redacted and made printable before it is stored: secrets never reach the database, and no NUL or escape
# code reaches a backend, a terminal or a page later.
_TO_COLUMN: dict[str, Callable[[Any], Any]] = {
    "message": store_text,
    "checks": lambda checks: [{"name": store_text(c.name), "message": store_text(c.message)} for c in checks],
    "prefill_worker_id": _u64,
    "decode_worker_id": _u64,
    "finish_reason": lambda value: store_text(value)[:32] if value is not None else None,
    "completion_excerpt": completion_excerpt,  # redacted, then cut
    "components": lambda value: clean_data(dict(value)),  # versions a host's tools printed
    "listeners": lambda value: [clean_data(dict(entry)) for entry in value],
}


def record_outcome(row: CellRun, outcome: CellOutcome) -> None:
    """Every stored column of the outcome (`STORED_COLUMNS`) onto its row, and the row finished."""
    for name in STORED_COLUMNS:
        value = getattr(outcome, name)
        convert = _TO_COLUMN.get(name)
        setattr(row, name, convert(value) if convert else dict(value) if isinstance(value, Mapping) else value)
    row.log_dir = outcome.log_dir or row.log_dir
    row.finished_at = utcnow()
