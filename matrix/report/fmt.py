"""Formatting of values for pages and tables: seconds, ratios, bytes, times, nested mappings.

Each function returns plain text; the templates escape it like any other value.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

__all__ = [
    "flatten", "fmt_bytes", "fmt_kv_ledger", "fmt_pairs", "fmt_peaks", "fmt_ratio", "fmt_seconds", "fmt_time",
    "fmt_value", "label",
]  # fmt: skip

DASH = "-"


def fmt_seconds(value: float | None) -> str:
    """``0.437 s``, ``46.6 s``; a dash when there is no value."""
    if value is None:
        return DASH
    if value < 10:
        return f"{value:.3f} s"
    return f"{value:.1f} s"


def fmt_age(seconds: float | None) -> str:
    """``3 d 4 h``, ``5 h 12 min``, ``42 s``: how long an episode has been open; a dash when unknown."""
    if seconds is None:
        return DASH
    minutes, hours, days = int(seconds // 60), int(seconds // 3600), int(seconds // 86400)
    if days:
        return f"{days} d {hours - 24 * days} h"
    if hours:
        return f"{hours} h {minutes - 60 * hours} min"
    return f"{minutes} min" if minutes else f"{int(seconds)} s"


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


# Words for the keys the runner records, so no page or terminal shows `cpu_s.decode` or `rss_bytes`.
LABELS: Mapping[str, str] = {
    "rss_bytes": "memory (RSS)",
    "cpu_s": "CPU time",
    "gpu_bytes": "GPU memory",
    "device_used_bytes": "GPU memory in use (device)",
    "memory_used_after": "GPU memory in use after",
    "startup_queue_s": "start-up queue",
    "startup_mode": "start-up mode",
    "startup_window": "start-up window",
    "startup_peers": "start-ups beside it",
    "baseline": "GPU memory before",
}


def label(key: str) -> str:
    """The words for a recorded key: a known one's label, else the key with spaces for underscores."""
    return LABELS.get(key, key.replace("_", " "))


def _leaf(key: str, value: Any) -> str:
    if isinstance(value, float) and (key.endswith("_s") or key == "seconds"):
        return fmt_seconds(value)
    return fmt_value(key, value)


def fmt_pairs(data: Mapping[str, Any], parent: str = "") -> str:
    """A recorded mapping as ``key value · key value``: nested mappings as ``label: key value, ...``,
    byte counts in units, seconds with their unit, lists joined; never a Python repr."""
    parts = []
    for key, value in data.items():
        unit_key = parent if parent.endswith(("_bytes", "_s")) else str(key)
        if isinstance(value, Mapping):
            inner = fmt_pairs(value, str(key))
            parts.append(f"{label(str(key))}: {inner}" if inner else f"{label(str(key))}: {DASH}")
        elif isinstance(value, list | tuple):
            parts.append(f"{label(str(key))} " + (", ".join(_leaf(str(key), v) for v in value) or DASH))
        else:
            name = str(key) if parent else label(str(key))
            parts.append(f"{name} {_leaf(unit_key, value)}")
    return (", " if parent else " · ").join(parts)


def fmt_peaks(peaks: Mapping[str, Any]) -> str:
    """``memory (RSS): prefill 24.7 MB, decode 24.6 MB · CPU time: prefill 0.080 s, ...``."""
    return fmt_pairs(peaks)


def fmt_rate(gb_per_s: float) -> str:
    """A transfer rate in the unit that keeps it short: ``12.4 GB/s``, ``897 MB/s``, ``5.9 MB/s``, ``640 kB/s``
    (decimal units, as the ledger's; a CPU pair moves kilobytes, a GPU pair gigabytes)."""
    for scale, unit in ((1.0, "GB/s"), (1e3, "MB/s")):
        if gb_per_s * scale >= 0.9995:  # what rounds to 1 at 3 digits: "1 GB/s", never "1e+03 MB/s"
            return f"{gb_per_s * scale:.3g} {unit}"
    return f"{gb_per_s * 1e6:.3g} kB/s"


def fmt_kv_ledger(ledger: Mapping[str, Any]) -> str:
    """``1 transfer(s), 5.8 kB in 0.994 ms (5.9 MB/s), from reference at ...``; "" without transfers."""
    transfers = ledger.get("transfers")
    if not transfers:
        return ""
    size = ledger.get("bytes")
    seconds = ledger.get("seconds")
    rate = ledger.get("gb_per_s")
    text = f"{transfers} transfer(s)"
    if isinstance(size, int | float):
        text += f", {fmt_bytes(size)}"
    if isinstance(seconds, int | float):
        text += f" in {seconds * 1000:.3f} ms" if seconds < 1 else f" in {fmt_seconds(seconds)}"
    if isinstance(rate, int | float):
        text += f" ({fmt_rate(rate)})"
    source = ledger.get("source")
    return text + (f", from {source}" if source else "")
