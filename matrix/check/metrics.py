"""Read Prometheus counters before and after the request: the `kv_transfer` check."""

from __future__ import annotations

import contextlib
import math
import re
import time
from pathlib import Path

import httpx

from matrix.check.http import loopback_client
from matrix.check.specs import CheckFailure, MetricsCheck

CHECK_NAME = "kv_transfer"


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _selector(spec: str) -> tuple[str, dict[str, str]]:
    """``name{label="value",...}`` -> (name, required labels); a bare name requires none."""
    name, brace, labels = spec.partition("{")
    return name, dict(_LABEL.findall(labels)) if brace else {}


def parse_counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of the samples of each named metric in Prometheus text format: over all label sets for a bare
    name, over the matching ones for ``name{label="value"}`` (e.g. the prompt tokens whose source was a KV
    transfer, not those computed locally)."""
    selectors = {spec: _selector(spec) for spec in names}
    wanted = {name for name, _labels in selectors.values()}
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ") if "{" not in line.split(" ", 1)[0] else line.partition("}")
        name, _brace, label_text = name_part.partition("{")
        if name not in wanted:
            continue
        fields = rest.split()
        try:
            value = float(fields[0]) if fields else math.nan
        except ValueError:
            continue
        if math.isnan(value):
            continue
        labels = dict(_LABEL.findall(label_text))
        for spec, (spec_name, required) in selectors.items():
            if spec_name == name and all(labels.get(k) == v for k, v in required.items()):
                totals[spec] += value
    return totals


def snapshot(
    checks: tuple[MetricsCheck, ...], timeout_s: float = 5.0, texts: dict[int, str] | None = None
) -> list[dict[str, float] | str]:
    """Counters of every check, or the error text when an endpoint cannot be read; `texts` receives what
    each readable endpoint answered, by the check's position."""
    results: list[dict[str, float] | str] = []
    with loopback_client(timeout_s) as client:
        for number, check in enumerate(checks):
            try:
                response = client.get(check.url)
                response.raise_for_status()
                results.append(parse_counters(response.text, check.counters))
                if texts is not None:
                    texts[number] = response.text
            except httpx.HTTPError as exc:
                results.append(f"cannot read {check.url}: {exc}")
    return results


def _record(checks: tuple[MetricsCheck, ...], texts: dict[int, str], prefix: str = "") -> None:
    """Keep the scrape of each check that asks for it; evidence, so a write error is not a failure."""
    for number, check in enumerate(checks):
        if check.record and number in texts:
            path = Path(check.record)
            with contextlib.suppress(OSError):
                path.with_name(prefix + path.name).write_text(texts[number], encoding="utf-8")


def baseline(checks: tuple[MetricsCheck, ...], texts: dict[int, str] | None = None) -> list[dict[str, float] | str]:
    """Counters before the request (kept as `before-<record>` beside the scrape after it); `texts` receives
    the scrapes themselves (the KV ledger reads them)."""
    texts = {} if texts is None else texts
    before = snapshot(checks, texts=texts)
    _record(checks, texts, prefix="before-")
    return before


SETTLE_S = 10.0
SETTLE_POLL_S = 0.25


def settle_window(status_code: int | None) -> float:
    """How long to wait for the counters after an answer: counters may lag a served request (vllm-rs relays
    them on an interval), but an error answer (a refused pair's 500) moved nothing worth waiting for, so its
    counters are read once. On a skew grid that is 10 s less per refused pair."""
    return SETTLE_S if status_code == 200 else 0.0


def grown(
    checks: tuple[MetricsCheck, ...], before: list[dict[str, float] | str], after: list[dict[str, float] | str]
) -> bool:
    """Whether every counter of every check grew (an unreadable endpoint never counts as grown)."""
    return not judge(checks, before, after)


def settle(
    checks: tuple[MetricsCheck, ...],
    before: list[dict[str, float] | str],
    window_s: float = SETTLE_S,
    texts: dict[int, str] | None = None,
) -> list[dict[str, float] | str]:
    """Counters after the request, read again until they grew or `window_s` passed.

    Some servers publish engine counters on an interval rather than at once (vllm-rs relays the Python
    engine's stats), so a single read right after the response could miss a transfer that happened.
    """
    deadline = time.monotonic() + window_s
    texts = {} if texts is None else texts
    after = snapshot(checks, texts=texts)
    while not grown(checks, before, after) and time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
        after = snapshot(checks, texts=texts)
    _record(checks, texts)
    return after


def judge(
    checks: tuple[MetricsCheck, ...], before: list[dict[str, float] | str], after: list[dict[str, float] | str]
) -> list[CheckFailure]:
    failures = []
    for check, old, new in zip(checks, before, after, strict=True):
        if isinstance(old, str) or isinstance(new, str):
            failures.append(CheckFailure(CHECK_NAME, old if isinstance(old, str) else str(new)))
            continue
        still = [counter for counter in check.counters if new[counter] <= old[counter]]
        if check.require == "any" and len(still) < len(check.counters):
            continue
        if check.require == "any":
            counts = ", ".join(f"{c} {old[c]:g} -> {new[c]:g}" for c in still)
            failures.append(CheckFailure(CHECK_NAME, f"none of {counts} on {check.url} grew during the request: "
                                         "decode did not use transferred KV (recomputed the prompt?)"))  # fmt: skip
            continue
        for counter in still:
            failures.append(
                CheckFailure(
                    CHECK_NAME,
                    f"{counter} on {check.url} did not grow during the request ({old[counter]:g} -> "
                    f"{new[counter]:g}): decode did not use transferred KV (recomputed the prompt?)",
                )
            )
    return failures
