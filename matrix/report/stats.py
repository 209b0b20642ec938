"""How sure the numbers are: pass rates with Wilson intervals, and two-sample comparisons of timings.

Pure functions over stored samples (no database, no I/O); `docs/statistics.md` says why these tests and
what their measured error rates are.

* Pass rate: k passes in n informative attempts, with the Wilson score 95 % interval. Unlike the normal
  approximation it stays inside [0, 1] and is honest at n = 3 or at 0 and n passes, the cases a flake
  gate meets most.
* Timings: B against A by the ratio of medians, a 95 % interval for the ratio (Hodges-Lehmann on the
  log scale, with the distribution-free Moses interval) and the two-sided Mann-Whitney U p-value. Both are
  rank based: latencies are skewed with rare long tails, so a t-test on means would be led by outliers.
  The p-value comes from `scipy.stats` (optional extra `stats`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from matrix.errors import MatrixError
from matrix.outcome import CELL_FAULT_STATUSES

# When a performance change is a regression: significant at DEFAULT_ALPHA (Mann-Whitney) and worse than
# DEFAULT_THRESHOLD (ratio of medians). Here, not in `perf`, so the CLI reads them without SQLAlchemy.
DEFAULT_THRESHOLD = 0.10
DEFAULT_ALPHA = 0.01

__all__ = [
    "Z95",
    "MetricComparison",
    "PassRate",
    "compare_samples",
    "pass_rate",
    "significance_available",
    "wilson",
]

Z95 = 1.959963984540054  # the standard normal quantile for a two-sided 95 % interval
INSTALL_HINT = "pip install 'disagg-matrix[stats]'"


class StatsMissingError(MatrixError):
    """scipy is not installed: the significance tests need it."""


def wilson(passed: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion; (0, 1) when there is no sample."""
    if total <= 0:
        return 0.0, 1.0
    p = passed / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    # Exact bounds at 0 and n passes (floating point would leave 1e-17 crumbs).
    low = 0.0 if passed == 0 else max(0.0, centre - half)
    high = 1.0 if passed == total else min(1.0, centre + half)
    return low, high


@dataclass(frozen=True)
class PassRate:
    """Passes and failures of one cell on one runtime, oldest first in `history` ("P" pass, "F" failure)."""

    passed: int
    failed: int
    history: str

    @property
    def samples(self) -> int:
        return self.passed + self.failed

    @property
    def rate(self) -> float | None:
        return self.passed / self.samples if self.samples else None

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.passed, self.samples)

    @property
    def flaky(self) -> bool:
        """Passed and failed on the same runtime: the cell's outcome is not a property of the runtime alone."""
        return self.passed > 0 and self.failed > 0

    def text(self) -> str:
        """``3/5 passed (60 %, 95 % CI 23-88 %)``."""
        if not self.samples:
            return "no informative attempt"
        low, high = self.interval
        return (f"{self.passed}/{self.samples} passed ({100 * (self.rate or 0):.0f} %, "
                f"95 % CI {100 * low:.0f}-{100 * high:.0f} %)")  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        low, high = self.interval
        return {"passed": self.passed, "failed": self.failed, "samples": self.samples, "rate": self.rate,
                "wilson_low": low, "wilson_high": high, "flaky": self.flaky, "history": self.history}  # fmt: skip


def pass_rate(statuses: Sequence[str]) -> PassRate:
    """The pass rate over attempts' statuses (oldest first). Only passes and the cell's own failures are
    samples: a skip, an interruption or a never-started attempt says nothing about the runtime."""
    history = "".join("P" if s == "passed" else "F" for s in statuses if s == "passed" or s in CELL_FAULT_STATUSES)
    return PassRate(history.count("P"), history.count("F"), history)


@dataclass(frozen=True)
class MetricComparison:
    """B against A for one metric: ratio of medians (B/A), its 95 % interval, and the Mann-Whitney p."""

    metric: str
    n_a: int
    n_b: int
    median_a: float
    median_b: float
    ratio: float
    low: float | None
    high: float | None
    p_value: float | None

    def significant(self, alpha: float) -> bool:
        return self.p_value is not None and self.p_value < alpha

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "n_a": self.n_a, "n_b": self.n_b, "median_a": self.median_a,
                "median_b": self.median_b, "ratio": self.ratio, "ratio_low": self.low, "ratio_high": self.high,
                "p_value": self.p_value}  # fmt: skip


def _mannwhitneyu() -> Any:
    try:
        from scipy.stats import mannwhitneyu
    except ImportError as exc:
        raise StatsMissingError(
            f"comparing timings with significance needs scipy, which is not installed: {INSTALL_HINT}"
        ) from exc
    return mannwhitneyu


def significance_available() -> bool:
    """Whether scipy is here for the p-values (without it, ratios and intervals are still computed). Found,
    not imported: importing scipy.stats costs about 0.6 s, and samples past `EXACT_MAX_N` never need it."""
    return importlib.util.find_spec("scipy") is not None


# scipy's Mann-Whitney ("auto") takes the normal approximation when both samples are larger than this (or
# when there are ties); up to it, with no ties, its exact distribution.
EXACT_MAX_N = 8


def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sided Mann-Whitney p-value as scipy's `mannwhitneyu(a, b)` gives it: past `EXACT_MAX_N` a
    side, its normal approximation with the tie and continuity corrections, computed here (the same floats,
    without importing scipy); otherwise scipy's own (its exact distribution)."""
    n1, n2 = len(a), len(b)
    if n1 <= EXACT_MAX_N or n2 <= EXACT_MAX_N:
        return float(_mannwhitneyu()(a, b, alternative="two-sided").pvalue)
    ranked = sorted([(value, 0) for value in a] + [(value, 1) for value in b])
    rank_sum_a, tie_term, i = 0.0, 0.0, 0
    while i < len(ranked):  # average ranks over runs of equal values
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        average = (i + j) / 2 + 1
        rank_sum_a += average * sum(1 for k in range(i, j + 1) if ranked[k][1] == 0)
        run = j - i + 1
        tie_term += run**3 - run
        i = j + 1
    u1 = rank_sum_a - n1 * (n1 + 1) / 2
    u = max(u1, n1 * n2 - u1)
    n = n1 + n2
    spread = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1))))
    if spread == 0:
        return 1.0  # every value equal: no evidence of a difference (scipy answers 1 too)
    z = (u - n1 * n2 / 2 - 0.5) / spread
    return min(1.0, math.erfc(z / math.sqrt(2)))


def hodges_lehmann_ratio(a: Sequence[float], b: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """exp of the Hodges-Lehmann shift of log(b) - log(a), with the Moses 95 % interval: (estimate, low, high).

    The Moses interval takes the k-th smallest and largest of the n*m pairwise differences, k from the
    normal approximation of the Mann-Whitney U distribution; it needs no assumption about the shape.
    The differences are never materialised: `_PairwiseDifferences.select` finds the k-th smallest in
    O((n + m) log(n m)) expected time, and returns the very float the sorted list would hold."""
    pairs = _PairwiseDifferences([math.log(x) for x in a], [math.log(y) for y in b])
    count = len(a) * len(b)
    # statistics.median's convention: the middle one, or the mean of the two middle ones.
    middle = count // 2
    estimate = pairs.select(middle) if count % 2 else (pairs.select(middle - 1) + pairs.select(middle)) / 2
    low, high = _moses(pairs, len(a), len(b), z)
    return math.exp(estimate), low, high


def moses_interval(a: Sequence[float], b: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """The (low, high) of `hodges_lehmann_ratio` without its estimate: what `compare_samples` reports.
    Two selections instead of three or four (the estimate's median ranks are the costliest to reach)."""
    return _cached_moses(tuple(a), tuple(b), z)


@functools.lru_cache(maxsize=4096)
def _cached_moses(a: tuple[float, ...], b: tuple[float, ...], z: float) -> tuple[float, float]:
    # A report asks for the same interval twice (a release's gate and the comparison with the release
    # before it read the same samples); hashing 2 x 200 floats costs microseconds, the interval milliseconds.
    pairs = _PairwiseDifferences([math.log(x) for x in a], [math.log(y) for y in b])
    return _moses(pairs, len(a), len(b), z)


def _moses(pairs: _PairwiseDifferences, n: int, m: int, z: float) -> tuple[float, float]:
    count = n * m
    k = math.floor(n * m / 2 - z * math.sqrt(n * m * (n + m + 1) / 12))
    if k < 1:  # too few samples for a 95 % interval: the widest one there is
        return math.exp(pairs.select(0)), math.exp(pairs.select(count - 1))
    low, high = pairs.select_two(k - 1, count - k)
    return math.exp(low), math.exp(high)


class _PairwiseDifferences:
    """The n*m differences y[j] - x[i] of two samples as an implicit sorted matrix, for exact selection.

    With x and y sorted ascending, row i (one x) rises with j and column j (one y) falls with i, and so it
    stays in floating point (rounding is monotone). Counting the differences below a value is therefore
    one O(n + m) staircase walk. Selection keeps, per row, the column range that may still hold the k-th
    smallest, and shrinks it between pivots drawn from the candidates (`select`; the answer is exact
    whatever the pivots, the seed only fixes the running time)."""

    # Below this many candidates left, sorting them is cheaper than another walk.
    _SORT_BELOW = 2048
    # Candidates sampled to bracket the rank: each round keeps about 4 / sqrt(_SAMPLE) of them.
    _SAMPLE = 1024

    def __init__(self, x: Sequence[float], y: Sequence[float]) -> None:
        self.x = sorted(x)
        self.y = sorted(y)

    def _below(self, pivot: float, strict: bool) -> list[int]:
        """Per row i, how many columns j have y[j] - x[i] < pivot (or <= pivot unless `strict`)."""
        x, y, m = self.x, self.y, len(self.y)
        counts: list[int] = []
        j = 0
        for xi in x:  # x rises, so each row's count is at least the previous one's
            if strict:
                while j < m and y[j] - xi < pivot:
                    j += 1
            else:
                while j < m and y[j] - xi <= pivot:
                    j += 1
            counts.append(j)
        return counts

    def _sample(self, low: list[int], high: list[int], left: int, chooser: random.Random) -> list[float]:
        """_SAMPLE candidates drawn uniformly (with replacement) among the `left` still possible, sorted.
        The draws are sorted first, so one walk down the rows places them all (a bisect and a `randrange`
        per draw were most of a gate's time at 10^5 attempts)."""
        x, y = self.x, self.y
        draws = sorted(min(left - 1, int(chooser.random() * left)) for _ in range(self._SAMPLE))
        picks = []
        row, before = 0, 0  # before: the candidates of the rows above `row`
        for pick in draws:
            while pick >= before + high[row] - low[row]:
                before += high[row] - low[row]
                row += 1
            picks.append(y[low[row] + pick - before] - x[row])
        picks.sort()
        return picks

    def select_two(self, first_rank: int, last_rank: int) -> tuple[float, float]:
        """`select` of two ranks (first <= last), sharing the first narrowing: one sample brackets both
        and two walks keep the candidates between, which hold both ranks with overwhelming probability
        (when not, each rank is selected on its own; the answers are exact either way)."""
        n, m = len(self.x), len(self.y)
        left = n * m
        if not 0 < first_rank <= last_rank < left - 1 or left <= self._SORT_BELOW:
            return self.select(first_rank), self.select(last_rank)
        sample = self._sample([0] * n, [m] * n, left, random.Random(first_rank ^ last_rank))
        spread = 2 * math.sqrt(len(sample))
        below = sample[max(0, int(first_rank * len(sample) / left - spread))]
        above = sample[min(len(sample) - 1, int(last_rank * len(sample) / left + spread))]
        less = self._below(below, strict=True)
        at_most = self._below(above, strict=False)
        if sum(less) <= first_rank and last_rank < sum(at_most):
            return self.select(first_rank, less, at_most), self.select(last_rank, less, at_most)
        return self.select(first_rank), self.select(last_rank)

    def select(self, rank: int, low: list[int] | None = None, high: list[int] | None = None) -> float:
        """The difference at 0-based `rank` of the ascending sorted n*m differences.

        Floyd-Rivest style: a random sample of the candidates left brackets the rank between two of its
        values, and two staircase walks keep only the candidates between them (about 1/10 of them, the
        rank inside with overwhelming probability; when it is outside, the side holding it is kept).
        With many ties the bracket may keep everything: one quickselect step on a random candidate then
        makes progress."""
        x, y = self.x, self.y
        n, m = len(x), len(y)
        if not 0 <= rank < n * m:
            raise IndexError(rank)
        if rank == 0:
            return y[0] - x[n - 1]
        if rank == n * m - 1:
            return y[m - 1] - x[0]
        # Per row, columns below low[i] are known to sort before the answer, and from high[i] on after it
        # (given: bounds a caller has proved for this rank, as `select_two` does).
        low = [0] * n if low is None else list(low)
        high = [m] * n if high is None else list(high)
        chooser = random.Random(rank)
        while True:
            known = sum(low)
            left = sum(high) - known
            if left <= self._SORT_BELOW:
                rest = sorted(y[j] - x[i] for i in range(n) for j in range(low[i], high[i]))
                return rest[rank - known]
            sample = self._sample(low, high, left, chooser)
            where = (rank - known) * len(sample) / left
            spread = 2 * math.sqrt(len(sample))  # the rank's place in the sample: sd at most sqrt(s) / 2
            first = sample[max(0, int(where - spread))]
            last = sample[min(len(sample) - 1, int(where + spread))]
            less = self._below(first, strict=True)
            if rank < sum(less):  # below the bracket
                high = [min(h, c) for h, c in zip(high, less, strict=True)]
                continue
            at_most = self._below(last, strict=False)
            if rank >= sum(at_most):  # above the bracket
                low = [max(lo, c) for lo, c in zip(low, at_most, strict=True)]
                continue
            if first == last:  # every difference between is this one value
                return first
            narrowed_low = [max(lo, c) for lo, c in zip(low, less, strict=True)]
            narrowed_high = [min(h, c) for h, c in zip(high, at_most, strict=True)]
            if sum(narrowed_high) - sum(narrowed_low) < left:
                low, high = narrowed_low, narrowed_high
                continue
            found = self._quickselect_step(rank, low, high, left, chooser)
            if found is not None:
                return found

    def _quickselect_step(
        self, rank: int, low: list[int], high: list[int], left: int, chooser: random.Random
    ) -> float | None:
        """Narrow `low`/`high` in place around one random candidate; that candidate if it is the answer."""
        x, y = self.x, self.y
        pick = chooser.randrange(left)
        pivot = 0.0
        for i in range(len(x)):
            width = high[i] - low[i]
            if pick < width:
                pivot = y[low[i] + pick] - x[i]
                break
            pick -= width
        less = self._below(pivot, strict=True)
        if rank < sum(less):
            high[:] = [min(h, c) for h, c in zip(high, less, strict=True)]
            return None
        at_most = self._below(pivot, strict=False)
        if rank < sum(at_most):
            return pivot
        low[:] = [max(lo, c) for lo, c in zip(low, at_most, strict=True)]
        return None


def compare_samples(
    metric: str, a: Sequence[float], b: Sequence[float], *, need_p: bool = True
) -> MetricComparison | None:
    """B against A; None without a positive sample on both sides. One sample a side gives the ratio only.
    Without `need_p` no p-value is computed (scipy is not installed): the ratio and interval still are."""
    a = [x for x in a if x > 0 and math.isfinite(x)]
    b = [x for x in b if x > 0 and math.isfinite(x)]
    if not a or not b:
        return None
    median_a, median_b = statistics.median(a), statistics.median(b)
    if len(a) < 2 or len(b) < 2:
        return MetricComparison(metric, len(a), len(b), median_a, median_b, median_b / median_a, None, None, None)
    low, high = moses_interval(a, b)
    p_value = mann_whitney_p(a, b) if need_p else None
    return MetricComparison(metric, len(a), len(b), median_a, median_b, median_b / median_a, low, high, p_value)
