"""Performance samples per attempt and their comparison between two sides, with significance.

A sample is one *passed* attempt: the timings of a failed one describe the failure, not the runtime.
Metrics (per attempt, from stored columns):

* `ready_s`, `ttft_s`, `request_s`: seconds, lower is better;
* `tokens_per_s`: completion tokens over request time, higher is better;
* `traffic_ttft_p50_s`, `traffic_ttft_p99_s`, `traffic_itl_p50_s`, `traffic_itl_p99_s` (lower is better) and
  `traffic_tokens_per_s` (higher): under a case's traffic profile (`matrix.check.traffic`, kept in
  `peaks["traffic"]`), where a slowdown under load shows that one request's timings hide;
* `kv_gb_per_s`, `kv_seconds`, `kv_bytes`: the KV-transfer ledger (`matrix.check.ledger`); the rate is
  better higher, the time lower; bytes have no better direction (a change says the transfer changed).

A metric *regresses* when B is worse than A by more than the threshold (ratio of medians past
1 + threshold for lower-is-better, below 1 - threshold for higher-is-better) AND the Mann-Whitney test
says the difference is significant (p < alpha). Either alone is not enough: a 3 % drop on one sample is
noise, and a significant 0.5 % change is not worth blocking a release for.

A metric with a better direction that neither regressed nor improved is *insufficient data* ([M30] item 4),
never "unchanged", when the evidence cannot rule a slowdown past the threshold out: fewer than two samples a
side, no significance test (scipy missing), or a 95 % interval of the ratio that straddles the threshold
(it holds both "within the threshold" and "worse than it").

Each side's samples are the newest `SAMPLE_WINDOW` passed attempts of each cell (a line of output says
"the newest a side" where a side reached it): a year of nightlies holds thousands per cell, more than any
test needs and with the older ones describing a host and a release long gone, and the window keeps `gate`
and `compare` from growing with the history. Exports keep every sample.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Case, CellRun
from matrix.outcome import PASSED
from matrix.report.data import raw_column
from matrix.report.stats import DEFAULT_ALPHA, DEFAULT_THRESHOLD, MetricComparison, compare_samples

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_THRESHOLD",
    "METRICS",
    "SAMPLE_WINDOW",
    "MetricVerdict",
    "Samples",
    "compare_metrics",
    "load_samples",
]

# The newest passed attempts per cell and runtime that a comparison reads (see the module docstring).
SAMPLE_WINDOW = 200

# Metric -> which way is better: "lower", "higher", or "" (reported, never a regression).
METRICS: Mapping[str, str] = {
    "ready_s": "lower",
    "ttft_s": "lower",
    "request_s": "lower",
    "tokens_per_s": "higher",
    "traffic_ttft_p50_s": "lower",
    "traffic_ttft_p99_s": "lower",
    "traffic_itl_p50_s": "lower",
    "traffic_itl_p99_s": "lower",
    "traffic_tokens_per_s": "higher",
    "kv_gb_per_s": "higher",
    "kv_seconds": "lower",
    "kv_bytes": "",
}

Samples = dict[str, list[float]]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def attempt_metrics(
    ready_s: float | None,
    ttft_s: float | None,
    request_s: float | None,
    completion_tokens: int | None,
    kv_ledger: Mapping[str, Any] | None,
    traffic: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """The metrics one attempt has (a missing one is absent, never zero); `traffic`: `peaks["traffic"]`."""
    found = {"ready_s": ready_s, "ttft_s": ttft_s, "request_s": request_s}
    if completion_tokens and request_s:
        found["tokens_per_s"] = completion_tokens / request_s
    ledger = kv_ledger or {}
    if ledger.get("transfers"):
        found["kv_bytes"] = _number(ledger.get("bytes"))
        found["kv_seconds"] = _number(ledger.get("seconds"))
        found["kv_gb_per_s"] = _number(ledger.get("gb_per_s"))
    load = traffic if isinstance(traffic, Mapping) else {}
    for part in ("ttft_s", "itl_s"):
        raw = load.get(part)
        quantiles: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        for q in ("p50", "p99"):
            found[f"traffic_{part[:-2]}_{q}_s"] = _number(quantiles.get(q))
    found["traffic_tokens_per_s"] = _number(load.get("tokens_per_second"))
    return {name: float(value) for name, value in found.items() if value is not None and value > 0}


def _decoded(value: Any, key: str) -> Any:
    """A JSON column's value (text, or an object from a driver that decodes JSON itself), decoded only
    when its text names `key` (a metric reads nothing else of it): otherwise None, as an absent key."""
    if isinstance(value, str):
        return json.loads(value) if key in value else None
    return value


def load_samples(
    session: Session, runtime_ids: Iterable[int], *, window: int | None = SAMPLE_WINDOW
) -> dict[tuple[int, int], Samples]:
    """(case id, runtime id) -> metric -> values of its newest `window` passed attempts (None: every one),
    oldest first. The window is chosen in SQL, so a year of nightlies costs what `window` attempts do."""
    ids = sorted(set(runtime_ids))
    out: dict[tuple[int, int], Samples] = defaultdict(lambda: defaultdict(list))
    if not ids:
        return {}
    # The JSON columns come as their stored text and are decoded only when they hold what a metric reads:
    # at 10^5 attempts SQLAlchemy's per-row JSON processing was a quarter of a gate's time.
    columns = (CellRun.id, CellRun.case_id, CellRun.runtime_id, CellRun.ready_s, CellRun.ttft_s, CellRun.request_s,
               CellRun.completion_tokens, raw_column(CellRun.kv_ledger), raw_column(CellRun.peaks))  # fmt: skip
    passed = (CellRun.status == PASSED, CellRun.roles_key == "")
    if window is None:
        rows: Iterable[Any] = session.execute(select(*columns).where(CellRun.runtime_id.in_(ids), *passed)
                                              .order_by(CellRun.id))  # fmt: skip
    else:
        # One query per cell, each a backwards range of the index `ix_cell_run_cell` cut at `window` rows: one
        # window function over every passed attempt of the runtimes sorted all of them (0.37 s at 10^5
        # attempts; this, 0.03 s). A cell without attempts costs one index probe.
        rows = []
        for case_id in session.scalars(select(Case.id).order_by(Case.id)):
            for runtime_id in ids:
                newest = (select(*columns).where(CellRun.case_id == case_id, CellRun.runtime_id == runtime_id, *passed)
                          .order_by(CellRun.id.desc()).limit(window))  # fmt: skip
                rows += reversed(session.execute(newest).all())
    for _id, case_id, runtime_id, ready, ttft, request, tokens, raw_ledger, raw_peaks in rows:
        ledger = _decoded(raw_ledger, '"transfers"')
        peaks = _decoded(raw_peaks, '"traffic"')
        traffic = peaks.get("traffic") if isinstance(peaks, dict) else None
        for name, value in attempt_metrics(ready, ttft, request, tokens, ledger, traffic).items():
            out[(case_id, runtime_id)][name].append(value)
    return {key: dict(metrics) for key, metrics in out.items()}


def pooled(samples: Mapping[tuple[int, int], Samples], case_id: int, runtime_ids: Iterable[int]) -> Samples:
    """One case's samples over several runtimes (a side of `compare --component`)."""
    merged: Samples = defaultdict(list)
    for runtime_id in runtime_ids:
        for name, values in samples.get((case_id, runtime_id), {}).items():
            merged[name].extend(values)
    return dict(merged)


@dataclass(frozen=True)
class MetricVerdict:
    """One metric of one case, B against A, and whether it is a regression under the thresholds."""

    comparison: MetricComparison
    direction: str
    regression: bool
    improvement: bool
    # Why the evidence cannot tell whether the metric is worse than the threshold ("": it can, or no direction).
    insufficient: str = ""

    @property
    def verdict(self) -> str:
        """regression | improvement | insufficient data | unchanged | "" (a metric with no better direction)."""
        if self.regression:
            return "regression"
        if self.improvement:
            return "improvement"
        if self.insufficient:
            return "insufficient data"
        return "unchanged" if self.direction else ""

    def text(self) -> str:
        c = self.comparison
        interval = f" [{c.low:.3f}, {c.high:.3f}]" if c.low is not None and c.high is not None else ""
        if c.p_value is not None:
            p = f", p={c.p_value:.2g}"
        elif c.n_a < 2 or c.n_b < 2:
            p = ", p=n/a (needs 2+ samples a side)"
        else:
            p = ", p=n/a (significance needs scipy: the [stats] extra)"
        mark = " REGRESSION" if self.regression else " improved" if self.improvement else ""
        if self.insufficient:
            mark = f" insufficient data ({self.insufficient})"
        newest = ", the newest a side" if max(c.n_a, c.n_b) >= SAMPLE_WINDOW else ""
        return f"{c.metric} x{c.ratio:.3f}{interval}{p} (n={c.n_a}/{c.n_b}{newest}){mark}"

    def as_dict(self) -> dict[str, Any]:
        return {**self.comparison.as_dict(), "better": self.direction or None, "regression": self.regression,
                "improvement": self.improvement, "class": self.verdict or None,
                "insufficient": self.insufficient or None}  # fmt: skip


def judge(comparison: MetricComparison, threshold: float, alpha: float) -> MetricVerdict:
    direction = METRICS.get(comparison.metric, "")
    significant = comparison.significant(alpha)
    worse = better = False
    if direction == "lower":
        worse, better = comparison.ratio > 1 + threshold, comparison.ratio < 1 - threshold
    elif direction == "higher":
        worse, better = comparison.ratio < 1 - threshold, comparison.ratio > 1 + threshold
    regression, improvement = significant and worse, significant and better
    why = "" if regression or improvement or not direction else insufficiency(comparison, direction, threshold)
    return MetricVerdict(comparison, direction, regression, improvement, why)


def insufficiency(comparison: MetricComparison, direction: str, threshold: float) -> str:
    """Why this comparison cannot rule out a change past the threshold in the worse direction ("": it can)."""
    c = comparison
    if c.n_a < 2 or c.n_b < 2:
        return f"too few samples: n={c.n_a}/{c.n_b}, needs 2+ a side"
    if c.p_value is None:
        return "not tested: significance needs scipy"
    if c.low is None or c.high is None:  # pragma: no cover - two samples a side always have an interval
        return "no interval"
    bound = 1 + threshold if direction == "lower" else 1 - threshold
    interval = f"the 95 % interval [{c.low:.3f}, {c.high:.3f}]"
    if c.low <= bound <= c.high:
        return f"{interval} straddles the threshold x{bound:.3f}"
    if (c.low > bound) if direction == "lower" else (c.high < bound):
        return f"{interval} lies past the threshold x{bound:.3f}, but the test found no significant change"
    return ""


def compare_metrics(
    a: Samples, b: Samples, threshold: float, alpha: float, *, need_p: bool = True
) -> list[MetricVerdict]:
    """Every metric both sides have, in `METRICS` order (`need_p=False`: no p-values, so no regression)."""
    found = []
    for metric in METRICS:
        comparison = compare_samples(metric, a.get(metric, ()), b.get(metric, ()), need_p=need_p)
        if comparison is not None:
            found.append(judge(comparison, threshold, alpha))
    return found


def check_thresholds(threshold: float, alpha: float) -> None:
    from matrix.errors import ConfigError

    if not 0 <= threshold < 10:
        raise ConfigError(f"the regression threshold must be a fraction from 0 to 10 (0.10 = 10 %), got {threshold}")
    if not 0 < alpha < 1:
        raise ConfigError(f"alpha must be between 0 and 1 (e.g. 0.01), got {alpha}")

