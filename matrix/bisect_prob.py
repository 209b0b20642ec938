"""Probabilistic bisection for a flaky break: where is the first bad version, and how sure are we?

Model: versions 0..n-1 oldest first; the first bad version b is one of 1..n-1 (0 is the good end, the bad
end n-1 failed for the user), uniform before any evidence. A version v >= b fails each attempt with
probability `rate` (the flake rate, e.g. 0.4); a version before b fails only by accident (EPSILON, so
one stray infrastructure failure cannot rule the truth out for ever). Every recorded attempt updates the
posterior over b (Bayes); the next probe is the version whose outcome is expected to shrink the
posterior's entropy most; the search stops once one version holds `confidence` of the mass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

EPSILON = 1e-3


def posterior(n: int, observations: Mapping[int, tuple[int, int]], rate: float) -> list[float]:
    """P(first bad = b) for b in 0..n-1 (0 has probability 0); observations: index -> (failures, passes)."""
    logs = [-math.inf] + [0.0] * (n - 1)
    bad_fail, bad_pass = math.log(rate), math.log1p(-rate)
    good_fail, good_pass = math.log(EPSILON), math.log1p(-EPSILON)
    for b in range(1, n):
        for v, (fails, passes) in observations.items():
            if v >= b:
                logs[b] += fails * bad_fail + passes * bad_pass
            else:
                logs[b] += fails * good_fail + passes * good_pass
    top = max(logs)
    weights = [math.exp(x - top) if x > -math.inf else 0.0 for x in logs]
    total = sum(weights)
    return [w / total for w in weights]


def _entropy(p: list[float]) -> float:
    total = sum(p)
    return -sum(x / total * math.log(x / total) for x in p if x > 0)


def next_version(p: list[float], rate: float) -> int:
    """The version (1..n-2) whose next attempt is expected to leave the least entropy in `p`."""
    n = len(p)
    if n <= 2:
        return n - 1
    best, best_index = math.inf, 1
    for v in range(1, n - 1):
        mass_bad = sum(p[1 : v + 1])  # P(v is bad)
        p_fail = mass_bad * rate + (1 - mass_bad) * EPSILON
        after_fail = [x * (rate if i <= v else EPSILON) for i, x in enumerate(p)]
        after_pass = [x * ((1 - rate) if i <= v else (1 - EPSILON)) for i, x in enumerate(p)]
        expected = p_fail * _entropy(after_fail) + (1 - p_fail) * _entropy(after_pass)
        if expected < best:
            best, best_index = expected, v
    return best_index
