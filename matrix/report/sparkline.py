"""Per-case sparklines: how long a cell took to get ready and to answer, across versions.

The page draws them as inline SVG polylines; this module only computes the coordinates (numbers), so
nothing user-provided ever reaches the SVG markup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Sparkline", "sparkline"]

WIDTH = 120
HEIGHT = 28
PAD = 2


@dataclass(frozen=True)
class Sparkline:
    width: int
    height: int
    ready: str  # SVG polyline points, e.g. "2.0,26.0 60.0,2.0"
    request: str
    summary: str  # the values in words, for the SVG <title> and screen readers


def _points(values: Sequence[float | None]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return ""
    low, high = min(present), max(present)
    span = (high - low) or 1.0
    step = (WIDTH - 2 * PAD) / max(1, len(values) - 1)
    points = []
    for index, value in enumerate(values):
        if value is None:
            continue
        x = PAD + index * step
        # Each series is scaled to its own range: a sparkline shows the trend, the title gives values.
        y = HEIGHT - PAD - (value - low) / span * (HEIGHT - 2 * PAD)
        points.append(f"{x:.1f},{y:.1f}")
    if len(points) == 1:  # one version: a short flat stroke instead of an invisible point
        x_text, y_text = points[0].split(",")
        points.append(f"{float(x_text) + 3:.1f},{y_text}")
    return " ".join(points)


def _range(name: str, values: Sequence[float | None]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return f"{name}: none"
    return f"{name} {min(present):.3f}-{max(present):.3f} s"


def sparkline(ready: Sequence[float | None], request: Sequence[float | None]) -> Sparkline | None:
    """A sparkline over versions (oldest first); None when no version has a timing."""
    if all(v is None for v in (*ready, *request)):
        return None
    summary = f"{_range('ready', ready)}, {_range('request', request)} over {len(ready)} version(s)"
    return Sparkline(WIDTH, HEIGHT, _points(ready), _points(request), summary)
