"""The KV-transfer ledger of one attempt: how many KV transfers the request caused, how many bytes they
moved, how long they took and at what rate, read from the engines' own Prometheus counters before and
after the request (the same scrapes the `kv_transfer` check judges).

Each engine names its counters differently; `SOURCES` says, per engine, which series count transfers,
bytes and seconds and in which units. The ledger is the difference after - before, so counters a server
accumulated before the request (warm-up, earlier requests) do not count. No matching series on any
scraped endpoint leaves the ledger empty: "not measured", never "zero bytes".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matrix.check.metrics import parse_counters

MIB = 1024 * 1024


@dataclass(frozen=True)
class Source:
    """Where one engine publishes its KV-transfer totals, and the units to turn them into bytes and seconds."""

    name: str
    transfers: str
    bytes: str
    seconds: str
    bytes_scale: float = 1.0
    seconds_scale: float = 1.0

    @property
    def series(self) -> tuple[str, ...]:
        return (self.transfers, self.bytes, self.seconds)


SOURCES: tuple[Source, ...] = (
    # vLLM's NIXL connector: per-transfer histograms on the engine that pulls the KV (decode).
    Source("vllm-nixl", "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum",
           "vllm:nixl_xfer_time_seconds_sum"),
    # SGLang's disaggregation: per-transfer histograms in MiB and milliseconds (recorded 0.5.21 scrapes:
    # 0.046875 MB in 8.6 ms is reported as 0.00532 GB/s, so MB and GB are binary there).
    Source("sglang", "sglang:kv_transfer_latency_ms_count", "sglang:kv_transfer_total_mb_sum",
           "sglang:kv_transfer_latency_ms_sum", bytes_scale=MIB, seconds_scale=0.001),
    # matrix's reference server (`matrix.reference.worker`).
    Source("reference", "matrix_reference:kv_transfers_total", "matrix_reference:kv_transfer_bytes_total",
           "matrix_reference:kv_transfer_seconds_total"),
)  # fmt: skip


def measure(before: str, after: str, where: str = "") -> dict[str, Any]:
    """The ledger of one endpoint from its scrapes before and after; {} when it publishes no known source.

    A source counts when any of its series appears in the scrape after the request (a counter a server
    has not touched yet may be absent before it)."""
    for source in SOURCES:
        if not any(_has_series(after, name) for name in source.series):
            continue
        old = parse_counters(before, source.series)
        new = parse_counters(after, source.series)
        transfers = max(0.0, new[source.transfers] - old[source.transfers])
        size = max(0.0, new[source.bytes] - old[source.bytes]) * source.bytes_scale
        seconds = max(0.0, new[source.seconds] - old[source.seconds]) * source.seconds_scale
        return {
            "transfers": round(transfers),
            "bytes": round(size),
            "seconds": seconds,
            # Decimal GB (1e9 bytes) per second: the unit network and NIXL benchmarks quote.
            "gb_per_s": size / seconds / 1e9 if seconds > 0 else None,
            "source": source.name + (f" at {where}" if where else ""),
        }
    return {}


def _has_series(text: str, name: str) -> bool:
    return any(line.startswith((name + " ", name + "{")) for line in text.splitlines())


def ledger(
    urls: Sequence[str], before: Mapping[int, str], after: Mapping[int, str], *, disjoint: bool = False
) -> dict[str, Any]:
    """The attempt's ledger from every scraped endpoint: the one that saw the most bytes (prefill and
    decode may both count the same transfer; adding them would count it twice). `disjoint`: each endpoint
    counts only its own transfers (the decodes of an xPyD topology), so their ledgers add up."""
    found = [measure(before[n], after[n], url) for n, url in enumerate(urls) if n in before and n in after]
    found = [entry for entry in found if entry]
    if disjoint and len(found) > 1:
        size, seconds = sum(e["bytes"] for e in found), sum(e["seconds"] for e in found)
        return {
            "transfers": sum(e["transfers"] for e in found),
            "bytes": size,
            "seconds": seconds,
            "gb_per_s": size / seconds / 1e9 if seconds > 0 else None,
            "source": f"{found[0]['source'].split(' at ')[0]} at {len(found)} endpoints",
        }
    return max(found, key=lambda entry: (entry["bytes"], entry["transfers"]), default={})
