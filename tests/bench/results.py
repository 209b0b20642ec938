"""Where benchmarks record their results: one Markdown section each, appended to docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def append_section(report: str) -> None:
    if not BENCHMARKS_MD.exists():
        BENCHMARKS_MD.write_text("# Benchmarks\n\nMeasured on demand; medians from one run, side by side.\n")
    with BENCHMARKS_MD.open("a", encoding="utf-8") as fh:
        fh.write(report)
