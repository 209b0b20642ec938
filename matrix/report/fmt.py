"""Formatting of values for pages and tables: seconds, ratios, bytes, times, nested mappings.

Each function returns plain text; the templates escape it like any other value.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

__all__ = ["flatten", "fmt_bytes", "fmt_ratio", "fmt_seconds", "fmt_time", "fmt_value"]

DASH = "-"


def fmt_seconds(value: float | None) -> str:
    """``0.437 s``, ``46.6 s``; a dash when there is no value."""
    if value is None:
        return DASH
    if value < 10:
        return f"{value:.3f} s"
    return f"{value:.1f} s"


def fmt_ratio(value: float | None) -> str:
    """``x1.23`` (B over A); a dash when there is no value."""
    return DASH if value is None else f"x{value:.2f}"


def fmt_bytes(value: float) -> str:
    """Decimal units, as NVML and `nvidia-smi` report memory: ``24.5 MB``."""
    size = float(value)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"  # pragma: no cover - the loop always returns


def fmt_time(value: dt.datetime | None) -> str:
    """UTC, to the second: ``2026-11-30 09:54:58Z``."""
    if value is None:
        return DASH
    if value.tzinfo is not None:  # SQLite gives naive UTC values back; other databases aware ones
        value = value.astimezone(dt.UTC).replace(tzinfo=None)
    return value.isoformat(sep=" ", timespec="seconds") + "Z"


def fmt_value(key: str, value: Any) -> str:
    """One leaf of a GPU/peaks mapping: byte counts in units, nothing as a dash, the rest as written."""
    if value is None:
        return DASH  # never Python's `None` on a page
    kind = type(value)
    if kind is int or kind is float:
        if "bytes" in key:
            return fmt_bytes(value)
        return f"{value:g}" if kind is float else str(value)
    return str(value)


def flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """A nested mapping as (dotted key, text) pairs: ``{"rss_bytes": {"decode": 24428544}}`` becomes
    ``[("rss_bytes.decode", "24.4 MB")]``. Lists are joined with commas."""
    pairs: list[tuple[str, str]] = []
    for key in sorted(data, key=str):
        value = data[key]
        name = f"{prefix}{key}"
        if isinstance(value, dict):  # JSON objects; a concrete type check is much cheaper than Mapping's
            pairs.extend(flatten(value, f"{name}."))
        elif isinstance(value, list | tuple):
            pairs.append((name, ", ".join(fmt_value(name, v) for v in value) or DASH))
        else:
            pairs.append((name, fmt_value(name, value)))
    return pairs
