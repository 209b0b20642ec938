"""[M15] the statistics: Wilson intervals, Hodges-Lehmann/Moses ratio intervals, Mann-Whitney p-values."""

from __future__ import annotations

import math
import random

import pytest

from matrix.report.perf import compare_metrics
from matrix.report.stats import compare_samples, hodges_lehmann_ratio, pass_rate, wilson


def test_wilson_matches_the_closed_form_and_stays_inside_zero_one() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(3, 3)
    assert low == pytest.approx(3 / (3 + 1.959963984540054**2)) and high == 1.0  # 0.4385: 3 of 3 shows little
    assert wilson(0, 10)[0] == 0.0
    low, high = wilson(21, 30)  # a 30 % flake over 30 repeats
    assert low == pytest.approx(0.5212, abs=1e-4) and high == pytest.approx(0.8334, abs=1e-4)
    assert wilson(73, 73)[0] > 0.95 > wilson(72, 72)[0]  # what min_pass_rate = 0.95 asks for


def test_pass_rate_counts_only_informative_attempts() -> None:
    rate = pass_rate(["passed", "skipped", "failed", "interrupted", "timeout", "not-run", "passed", "running"])
    assert (rate.passed, rate.failed, rate.history) == (2, 2, "PFFP")
    assert rate.flaky and rate.samples == 4
    assert rate.text() == "2/4 passed (50 %, 95 % CI 15-85 %)"
    assert not pass_rate(["passed", "passed"]).flaky and pass_rate([]).text() == "no informative attempt"


def test_moses_interval_of_a_known_shift() -> None:
    a = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9]
    b = [x * 1.2 for x in a]
    estimate, low, high = hodges_lehmann_ratio(a, b)
    assert low < 1.2 < high and estimate == pytest.approx(1.2, rel=0.05)


def lognormal(rng: random.Random, n: int, scale: float = 1.0, sigma: float = 0.1) -> list[float]:
    return [scale * math.exp(rng.gauss(0, sigma)) for _ in range(n)]


def test_a_15_percent_slowdown_at_n_30_is_significant_and_a_regression() -> None:
    rng = random.Random(15)
    a, b = lognormal(rng, 30), lognormal(rng, 30, 1.15)
    comparison = compare_samples("request_s", a, b)
    assert comparison is not None and comparison.p_value is not None
    assert comparison.p_value < 0.01 and comparison.low is not None and comparison.low > 1.0
    (verdict,) = compare_metrics({"request_s": a}, {"request_s": b}, threshold=0.10, alpha=0.01)
    assert verdict.regression and "REGRESSION" in verdict.text()
    # Higher is better for throughput: the same ratio is an improvement there.
    (faster,) = compare_metrics({"tokens_per_s": a}, {"tokens_per_s": b}, threshold=0.10, alpha=0.01)
    assert faster.improvement and not faster.regression


def test_a_small_but_significant_change_is_not_a_regression() -> None:
    rng = random.Random(3)
    a, b = lognormal(rng, 200, sigma=0.01), lognormal(rng, 200, 1.03, sigma=0.01)
    (verdict,) = compare_metrics({"request_s": a}, {"request_s": b}, threshold=0.10, alpha=0.01)
    assert verdict.comparison.significant(0.01) and not verdict.regression


def test_a_a_comparisons_flag_at_most_5_of_100() -> None:
    """The false-positive rate on seeded samples (docs/statistics.md has the measured rates)."""
    rng = random.Random(2026)
    flagged = 0
    for _ in range(100):
        a, b = lognormal(rng, 30), lognormal(rng, 30)
        (verdict,) = compare_metrics({"request_s": a}, {"request_s": b}, threshold=0.10, alpha=0.01)
        flagged += verdict.regression
    assert flagged <= 5


def test_one_sample_a_side_gives_a_ratio_without_a_test() -> None:
    comparison = compare_samples("ready_s", [2.0], [3.0])
    assert comparison is not None and comparison.ratio == 1.5 and comparison.p_value is None
    assert compare_samples("ready_s", [], [1.0]) is None


