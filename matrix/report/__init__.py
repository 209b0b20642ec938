"""Reports from the results database: HTML pages by version, comparisons, release gates, JUnit, Markdown, JSON.

`write_report(session, out_dir, selection)` writes the HTML report and returns the index page's path;
`matrix run` calls `refresh_report(session, out_dir, campaigns)` when its campaigns end, which rewrites only
the pages they reach when the report there was written from the same inputs (`matrix.report.refresh`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sqlalchemy.orm import Session

    from matrix.plan import Selection
    from matrix.report.render import Written

__all__ = ["refresh_report", "write_report"]


def write_report(session: Session, out_dir: Path, selection: Selection | None = None) -> Path:
    """Write the HTML report into `out_dir`; return the path of its index page."""
    from matrix.report.render import write_report as _write_report  # Jinja2 is imported only when used

    return _write_report(session, out_dir, selection)


def refresh_report(session: Session, out_dir: Path, campaigns: Sequence[int]) -> Written:
    """After `matrix run` of `campaigns`: rewrite the pages they reach, or all of them (`render.refresh_report`)."""
    from matrix.report.render import refresh_report as _refresh_report

    return _refresh_report(session, out_dir, campaigns)
