"""`matrix export csv`: one row per cell in scope with its pass rate (Wilson 95 % interval), flakiness and
median timings over its passed attempts, for spreadsheets and dashboards.

Every value is plain text a spreadsheet cannot take for a formula (`=`, `+`, `-`, `@` first are quoted
with a leading apostrophe: CSV injection).
"""

from __future__ import annotations

import csv
import io
import statistics

from sqlalchemy.orm import Session

from matrix.cells import ROLES
from matrix.report.data import Results
from matrix.report.perf import METRICS, load_samples
from matrix.report.skew import SkewEntry, skew_grids
from matrix.report.stats import pass_rate
from matrix.text import clean

__all__ = ["COLUMNS", "export_csv"]

COLUMNS = (
    "case", "backend", "version", "status", "samples", "passed", "failed", "pass_rate", "wilson_low",
    "wilson_high", "flaky", "history", *(f"median_{metric}" for metric in METRICS),
    # Each role's version (a diagonal cell's are its version) and, for a skew cell, its outcome class.
    "frontend", "prefill", "decode", "skew_class",
)  # fmt: skip


def _safe(value: object) -> str:
    text = clean("" if value is None else str(value))
    return "'" + text if text[:1] in ("=", "+", "-", "@") and not _is_number(text) else text


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def export_csv(session: Session, results: Results) -> str:
    samples = load_samples(session, [r.id for r in results.runtimes], window=None)  # an export keeps them all
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for runtime in results.runtimes:
        for cell in results.cells_of_runtime(runtime.id):
            rate = pass_rate([a.status for a in cell.attempts])
            low, high = rate.interval
            last = cell.latest
            metrics = samples.get((cell.case.id, runtime.id), {})
            medians = [statistics.median(metrics[m]) if metrics.get(m) else None for m in METRICS]
            row = [cell.case.name, runtime.backend, runtime.version, last.status if last else "none", rate.samples,
                   rate.passed, rate.failed, rate.rate, low if rate.samples else None,
                   high if rate.samples else None, rate.flaky, rate.history, *medians,
                   runtime.version, runtime.version, runtime.version, ""]  # fmt: skip
            writer.writerow([_safe(value) for value in row])
    for grid in skew_grids(session, [c.name for c in results.cases], results.campaign_id):
        for entry in grid.entries:
            if entry.skewed:  # the diagonal's rows are above, with their timings
                writer.writerow([_safe(value) for value in _skew_row(grid.backend, entry)])
    return out.getvalue()


def _skew_row(backend: str, entry: SkewEntry) -> list[object]:
    """A skew cell's row: its attempts' pass rate and its class; its timings are not aggregated (blank)."""
    rate = pass_rate(list(entry.statuses))
    low, high = rate.interval
    return [entry.cell.split("@", 1)[0], backend, entry.roles["decode"], entry.status, rate.samples, rate.passed,
            rate.failed, rate.rate, low if rate.samples else None, high if rate.samples else None, rate.flaky,
            rate.history, *(None for _ in METRICS), *(entry.roles[role] for role in ROLES), entry.verdict.cls]
