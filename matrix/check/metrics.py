"""Read Prometheus counters before and after the request: the `kv_transfer` check."""

from __future__ import annotations

import math

import httpx

from matrix.check.http import loopback_client
from matrix.check.validate import CheckFailure
from matrix.launch.plan import MetricsCheck

CHECK_NAME = "kv_transfer"


def parse_counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample of each named metric (over all label sets) in Prometheus text format."""
    wanted = set(names)
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ") if "{" not in line.split(" ", 1)[0] else line.partition("}")
        name = name_part.split("{", 1)[0]
        if name not in wanted:
            continue
        fields = rest.split()
        try:
            value = float(fields[0]) if fields else math.nan
        except ValueError:
            continue
        if not math.isnan(value):
            totals[name] += value
    return totals


def snapshot(checks: tuple[MetricsCheck, ...], timeout_s: float = 5.0) -> list[dict[str, float] | str]:
    """Counters of every check, or the error text when an endpoint cannot be read."""
    results: list[dict[str, float] | str] = []
    with loopback_client(timeout_s) as client:
        for check in checks:
            try:
                response = client.get(check.url)
                response.raise_for_status()
                results.append(parse_counters(response.text, check.counters))
            except httpx.HTTPError as exc:
                results.append(f"cannot read {check.url}: {exc}")
    return results


def judge(
    checks: tuple[MetricsCheck, ...], before: list[dict[str, float] | str], after: list[dict[str, float] | str]
) -> list[CheckFailure]:
    failures = []
    for check, old, new in zip(checks, before, after, strict=True):
        if isinstance(old, str) or isinstance(new, str):
            failures.append(CheckFailure(CHECK_NAME, old if isinstance(old, str) else str(new)))
            continue
        for counter in check.counters:
            if new[counter] <= old[counter]:
                failures.append(
                    CheckFailure(
                        CHECK_NAME,
                        f"{counter} on {check.url} did not grow during the request ({old[counter]:g} -> "
                        f"{new[counter]:g}): decode did not use transferred KV (recomputed the prompt?)",
                    )
                )
    return failures
