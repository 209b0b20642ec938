"""Probabilistic bisection for a flaky break: where is the first bad version, and how sure are we?

Model: versions 0..n-1 oldest first; the first bad version b is one of 1..n-1 (0 is the good end, the bad
end n-1 failed for the user), uniform before any evidence. A version v >= b fails each attempt with
probability `rate` (the flake rate, e.g. 0.4); a version before b fails only by accident (EPSILON, so
one stray infrastructure failure cannot rule the truth out for ever). Every recorded attempt updates the
posterior over b (Bayes); the next probe is the version whose outcome is expected to shrink the
posterior's entropy most; the search stops once one version holds `confidence` of the mass.

An attempt is a use of a Z-channel: its input is whether the probed version is bad, its output fail or
pass; a bad version passes with probability 1 - rate, a good one (almost) never fails. The information an
attempt at v gives about b depends only on q = P(v is bad), so the greedy probe is the version whose q
is nearest the channel's capacity-achieving input (q ~ 0.40 at rate 0.4: C ~ 0.246 bit per attempt).
docs/bisect.md compares this search with the information-theoretic bound and with non-greedy ones.
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


def _h(x: float) -> float:
    """Binary entropy in nats."""
    return 0.0 if x <= 0 or x >= 1 else -(x * math.log(x) + (1 - x) * math.log1p(-x))


def information(q: float, rate: float) -> float:
    """Mutual information (nats) between b and one attempt at a version that is bad with probability q:
    H(outcome) - H(outcome | b), the entropy the posterior loses on average. Maximal at the capacity-
    achieving q of the Z-channel."""
    p_fail = q * rate + (1 - q) * EPSILON
    return _h(p_fail) - q * _h(rate) - (1 - q) * _h(EPSILON)


def next_version(p: list[float], rate: float) -> int:
    """The version (1..n-2) whose next attempt is expected to leave the least entropy in `p`: the most
    informative one (the posterior's expected entropy after the attempt is H(p) - `information`)."""
    n = len(p)
    if n <= 2:
        return n - 1
    best, best_index, mass_bad = -math.inf, 1, 0.0
    for v in range(1, n - 1):
        mass_bad += p[v]  # P(v is bad) = P(b <= v)
        gain = information(mass_bad, rate)
        if gain > best:
            best, best_index = gain, v
    return best_index
