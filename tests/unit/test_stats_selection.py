"""The Hodges-Lehmann ratio by exact selection gives the very floats of sorting every pairwise difference."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

import pytest

from matrix.report.stats import Z95, _PairwiseDifferences, hodges_lehmann_ratio, mann_whitney_p


def brute_force(a: Sequence[float], b: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """The former implementation, kept as the oracle: sort all n*m differences."""
    diffs = sorted(math.log(y) - math.log(x) for x in a for y in b)
    n, m = len(a), len(b)
    count = len(diffs)
    estimate = statistics.median(diffs)
    k = math.floor(n * m / 2 - z * math.sqrt(n * m * (n + m + 1) / 12))
    if k < 1:
        return math.exp(estimate), math.exp(diffs[0]), math.exp(diffs[-1])
    return math.exp(estimate), math.exp(diffs[k - 1]), math.exp(diffs[count - k])


def _sample(rng: random.Random, size: int) -> list[float]:
    kind = rng.choice(["lognormal", "ties", "constant", "wide"])
    if kind == "lognormal":
        return [rng.lognormvariate(0, 0.3) * 100 for _ in range(size)]
    if kind == "ties":  # timings rounded to whole milliseconds: many equal differences
        return [float(rng.randint(95, 105)) for _ in range(size)]
    if kind == "constant":
        return [42.0] * size
    return [10 ** rng.uniform(-3, 6) for _ in range(size)]


def test_matches_the_brute_force_on_many_random_samples() -> None:
    rng = random.Random(20261204)
    for _ in range(400):
        a = _sample(rng, rng.randint(1, 40))
        b = _sample(rng, rng.randint(1, 40))
        assert hodges_lehmann_ratio(a, b) == brute_force(a, b), (a, b)


def test_matches_the_brute_force_past_the_sorting_threshold() -> None:
    rng = random.Random(7)
    for size_a, size_b in [(60, 61), (100, 100), (150, 37), (1, 3000), (300, 250)]:
        a = _sample(rng, size_a)
        b = _sample(rng, size_b)
        assert hodges_lehmann_ratio(a, b) == brute_force(a, b), (size_a, size_b)


class _NeverSorts(_PairwiseDifferences):
    _SORT_BELOW = 0  # every rank found by pivoting alone


def test_every_rank_by_pivoting_alone() -> None:
    rng = random.Random(3)
    for _ in range(30):
        x = [math.log(v) for v in _sample(rng, rng.randint(1, 12))]
        y = [math.log(v) for v in _sample(rng, rng.randint(1, 12))]
        diffs = sorted(b - a for a in x for b in y)
        pairs = _NeverSorts(x, y)
        assert [pairs.select(r) for r in range(len(diffs))] == diffs


def test_two_values_only_still_narrow() -> None:
    """Differences of two values: a sample's bracket holds every candidate, and selection must still end."""
    x, y = [0.0] * 6, [0.0, 1.0] * 6
    diffs = sorted(b - a for a in x for b in y)
    pairs = _NeverSorts(x, y)
    assert [pairs.select(r) for r in range(len(diffs))] == diffs


class _SmallSample(_NeverSorts):
    _SAMPLE = 16  # a sample this small often brackets wrongly: select_two's fallback runs too


def test_two_ranks_sharing_one_narrowing() -> None:
    """select_two (the interval's two ranks) returns what the sorted differences hold, ties included."""
    rng = random.Random(11)
    for _ in range(60):
        x = [round(rng.gauss(0, 1), 1) for _ in range(rng.randint(2, 60))]
        y = [round(rng.gauss(0.2, 1), 1) for _ in range(rng.randint(2, 60))]
        diffs = sorted(b - a for a in x for b in y)
        pairs = _SmallSample(x, y)
        for _ in range(5):
            first, last = sorted((rng.randrange(len(diffs)), rng.randrange(len(diffs))))
            assert pairs.select_two(first, last) == (diffs[first], diffs[last]), (x, y, first, last)


def test_the_mann_whitney_p_past_the_exact_sizes_is_scipys_own() -> None:
    # Computed here so that a gate at 10^5 attempts need not import scipy.stats (0.6 s): the same floats.
    mannwhitneyu = pytest.importorskip("scipy.stats").mannwhitneyu
    rng = random.Random(7)
    for n1, n2 in ((9, 9), (12, 40), (200, 200), (9, 300)):
        for tied in (False, True):
            draw = (lambda: float(rng.randint(0, 5))) if tied else (lambda: rng.lognormvariate(0, 0.3))
            a = [draw() for _ in range(n1)]
            b = [draw() * 1.1 for _ in range(n2)]
            expected = float(mannwhitneyu(a, b, alternative="two-sided").pvalue)
            assert mann_whitney_p(a, b) == pytest.approx(expected, rel=1e-9, abs=1e-300), (n1, n2, tied)
    assert mann_whitney_p([1.0] * 10, [1.0] * 10) == 1.0
