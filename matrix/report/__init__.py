"""Reports from the results database: HTML pages by version, comparisons, release gates, JUnit, Markdown, JSON.

`write_report(session, out_dir, selection)` writes the HTML report and returns the index page's path;
`matrix run` calls it to refresh the report when a campaign ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from matrix.plan import Selection

__all__ = ["write_report"]


def write_report(session: Session, out_dir: Path, selection: Selection | None = None) -> Path:
    """Write the HTML report into `out_dir`; return the path of its index page."""
    from matrix.report.render import write_report as _write_report  # Jinja2 is imported only when used

    return _write_report(session, out_dir, selection)
