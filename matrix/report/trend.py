"""Per-case trend charts: ready time and request time per version, with the spread of repeats.

Drawn once a case has timings on two versions or more (one point is no trend). Each series gets its own
panel and scale (ready is ~100x request): a line through the median per version, a whisker from the
fastest to the slowest repeat, the axis' range in seconds and the first and last version under it. This
module computes only numbers and labels; the template escapes every label like any other text.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from matrix.report.fmt import fmt_seconds

__all__ = ["Panel", "Point", "Trend", "trend"]

LEFT = 52  # room for the axis labels
WIDTH = 220
PANEL_H = 30
GAP = 8
TICKS_H = 14
DOT_R = 2.0


@dataclass(frozen=True)
class Point:
    x: float
    y: float  # the median
    low: float  # y of the fastest repeat (a larger y is lower on the page)
    high: float  # y of the slowest repeat
    title: str  # version and values in words


@dataclass(frozen=True)
class Panel:
    name: str  # "ready" or "request": the CSS class of its line
    top: float
    bottom: float
    high_label: str
    low_label: str
    line: str  # SVG polyline points through the medians
    points: tuple[Point, ...]


@dataclass(frozen=True)
class Trend:
    width: int
    height: int
    panels: tuple[Panel, ...]
    first: str  # the oldest version with a timing, under the x axis on the left
    last: str
    summary: str  # for the SVG <title> and screen readers


def _x(index: int, count: int) -> float:
    return LEFT + 4 + index * (WIDTH - LEFT - 8) / max(1, count - 1)


def _panel(name: str, top: float, versions: Sequence[str], series: Sequence[Sequence[float]]) -> Panel | None:
    present = [(i, sorted(values)) for i, values in enumerate(series) if values]
    if len(present) < 2:
        return None
    low = min(values[0] for _, values in present)
    high = max(values[-1] for _, values in present)
    span = (high - low) or 1.0
    bottom = top + PANEL_H

    def y(value: float) -> float:
        return bottom - (value - low) / span * PANEL_H if high > low else top + PANEL_H / 2

    points = []
    for index, values in present:
        median = statistics.median(values)
        spread = (
            f", {len(values)} runs {fmt_seconds(values[0])} to {fmt_seconds(values[-1])}" if len(values) > 1 else ""
        )
        points.append(Point(_x(index, len(series)), y(median), y(values[0]), y(values[-1]),
                            f"{versions[index]}: {name} {fmt_seconds(median)} (median{spread})"))  # fmt: skip
    line = " ".join(f"{p.x:.1f},{p.y:.1f}" for p in points)
    return Panel(name, top, bottom, fmt_seconds(high), fmt_seconds(low), line, tuple(points))


def trend(
    versions: Sequence[str], ready: Sequence[Sequence[float]], request: Sequence[Sequence[float]]
) -> Trend | None:
    """A chart over `versions` (oldest first) from every recorded repeat per version; None below two points."""
    panels: list[Panel] = []
    for name, series in (("ready", ready), ("request", request)):
        panel = _panel(name, GAP / 2 + len(panels) * (PANEL_H + GAP), versions, series)
        if panel is not None:
            panels.append(panel)
    if not panels:
        return None
    timed = [i for i in range(len(versions)) if ready[i] or request[i]]
    height = int(GAP / 2 + len(panels) * (PANEL_H + GAP) + TICKS_H)
    summary = "; ".join(f"{p.name} {p.low_label} to {p.high_label} over {len(p.points)} versions" for p in panels)
    return Trend(WIDTH, height, tuple(panels), versions[timed[0]], versions[timed[-1]], summary)
