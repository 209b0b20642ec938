"""Benchmark: the probabilistic bisection's search (`matrix.bisect_prob`) by Monte Carlo, against the
information-theoretic bound and against non-greedy searches.

64 versions, the first bad one uniform in 1..63, a bad version failing 40 % of its attempts, a good one
never: the acceptance's planted 40 % flake, simulated (no cells run). Every search meets the same
*worlds*: a world fixes the first bad version and, for each version, the outcomes of its 1st, 2nd, ...
attempt, so two searches differ only by their choices and their difference is measured paired.

Searches: `now` is `next_version` (the most informative attempt); `before` is the former code of the
same rule (expected entropy of both outcomes, computed in O(n^2); it must choose identically);
`two-step` looks two attempts ahead; `mi-ejs` is Naghshvar and Javidi's rule (the most informative
attempt until one version holds half the mass, then the largest extrinsic Jensen-Shannon divergence);
`confirm` exploits that a failure is near-decisive: once one version c holds half the mass, it probes
c-1 or c, whichever an exact dynamic programme says needs fewer expected attempts if c is the answer.

Run: python tests/bench/bench_bisect_search.py [--runs 1000] [--alt-runs 200]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from matrix.bisect_prob import EPSILON, information, next_version, posterior  # noqa: E402
from tests.bench.results import append_section  # noqa: E402

N, RATE, CONFIDENCE, CAP, BUDGET = 64, 0.4, 0.95, 200, 25
Search = Callable[[list[float], float], int]


def bound() -> tuple[float, float, float]:
    """(capacity of the Z-channel in bits per attempt, bits needed by Fano, the bound on E[attempts])."""
    crossover = 1 - RATE  # a bad version passes
    capacity = math.log2(1 + (1 - crossover) * crossover ** (crossover / (1 - crossover)))
    m, error = N - 1, 1 - CONFIDENCE
    h = -(error * math.log2(error) + (1 - error) * math.log2(1 - error))
    needed = math.log2(m) - h - error * math.log2(m - 1)  # Fano: I(b; outcomes) >= this
    return capacity, needed, needed / capacity  # and I(b; outcomes) <= C * E[T] (feedback, stopping time)


def before(p: list[float], rate: float) -> int:
    """The search as it was: the expected entropy of the posterior after either outcome, every version."""

    def entropy(w: list[float]) -> float:
        total = sum(w)
        return -sum(x / total * math.log(x / total) for x in w if x > 0)

    best, best_index = math.inf, 1
    for v in range(1, len(p) - 1):
        mass_bad = sum(p[1 : v + 1])
        p_fail = mass_bad * rate + (1 - mass_bad) * EPSILON
        after_fail = [x * (rate if i <= v else EPSILON) for i, x in enumerate(p)]
        after_pass = [x * ((1 - rate) if i <= v else (1 - EPSILON)) for i, x in enumerate(p)]
        expected = p_fail * entropy(after_fail) + (1 - p_fail) * entropy(after_pass)
        if expected < best:
            best, best_index = expected, v
    return best_index


def two_step(p: list[float], rate: float) -> int:
    """Maximise the information of this attempt plus that of the best next one after either outcome."""
    prefix = [sum(p[: i + 1]) for i in range(len(p))]
    best, best_index = -math.inf, 1
    for v in range(1, len(p) - 1):
        q = prefix[v]
        total = information(q, rate)
        for like_bad, like_good in ((rate, EPSILON), (1 - rate, 1 - EPSILON)):
            z = like_bad * q + like_good * (1 - q)
            after = [(like_bad * prefix[w] if w <= v else like_bad * q + like_good * (prefix[w] - q)) / z
                     for w in range(1, len(p) - 1)]  # fmt: skip
            total += z * max(information(x, rate) for x in after)
        if total > best:
            best, best_index = total, v
    return best_index


def _kl(a: float, b: float) -> float:
    return sum(x * math.log(x / y) for x, y in ((a, b), (1 - a, 1 - b)) if x > 0)


def mi_ejs(p: list[float], rate: float) -> int:
    if max(p) < 0.5:
        return next_version(p, rate)
    prefix = [sum(p[: i + 1]) for i in range(len(p))]

    def ejs(v: int) -> float:
        q, total = prefix[v], 0.0
        for i in range(1, len(p)):
            if 0 < p[i] < 1:
                own, bad_others = (rate, q - p[i]) if i <= v else (EPSILON, q)
                mixture = (bad_others * rate + (1 - p[i] - bad_others) * EPSILON) / (1 - p[i])
                total += p[i] * _kl(own, mixture)
        return total

    return max(range(1, len(p) - 1), key=ejs)


def _confirm_probe(above: float, below: float) -> str:
    """"low" (probe c-1) or "at" (probe c): the one that needs fewer expected attempts until the leader c
    holds CONFIDENCE if c is the answer. `above`, `below`: the mass after / before c relative to c's.
    Under that hypothesis a pass at c-1 shrinks `below` by 1 - RATE; an attempt at c fails with RATE
    (`above` shrinks by EPSILON / RATE) or passes (`above` grows by 1 / (1 - RATE)): a small exact
    programme over the counts (m, j, i) of those three events, at most 30 passes at c deep."""
    target = math.log((1 - CONFIDENCE) / CONFIDENCE)
    a0 = math.log(above) if above > 0 else -50.0
    b0 = math.log(below) if below > 0 else -50.0
    up, down = math.log((1 - EPSILON) / (1 - RATE)), math.log(RATE / EPSILON)
    memo: dict[tuple[int, int, int], tuple[float, str]] = {}

    def cost(i: int, j: int, m: int) -> tuple[float, str]:
        if (i, j, m) not in memo:
            a, b = a0 + i * up - j * down, b0 - m * up
            if math.log(math.exp(a) + math.exp(b)) <= target:
                memo[i, j, m] = (0.0, "")
            else:
                low = 1 + cost(i, j, m + 1)[0] if b > target - 12 else math.inf
                if a < target - 12:
                    at = math.inf
                elif i >= 30:  # deep enough: probe c until it fails
                    at = 1 / RATE + cost(i, j + 1, m)[0]
                else:
                    at = 1 + RATE * cost(i, j + 1, m)[0] + (1 - RATE) * cost(i + 1, j, m)[0]
                memo[i, j, m] = (low, "low") if low <= at else (at, "at")
        return memo[i, j, m]

    return cost(0, 0, 0)[1]


def confirm(p: list[float], rate: float) -> int:
    c = max(range(len(p)), key=lambda i: p[i])
    if p[c] < 0.5 or c <= 1 or c >= len(p) - 1:
        return next_version(p, rate)
    return c - 1 if _confirm_probe(sum(p[c + 1 :]) / p[c], sum(p[1:c]) / p[c]) == "low" else c


def world(seed: int) -> tuple[int, list[list[float]]]:
    rng = random.Random(seed)
    return rng.randrange(1, N), [[rng.random() for _ in range(CAP)] for _ in range(N)]


def search(choose: Search, first_bad: int, draws: list[list[float]]) -> tuple[bool, int, float]:
    """(right, attempts, seconds spent choosing) of one search in one world."""
    observations: dict[int, tuple[int, int]] = {}
    attempts, choosing = 0, 0.0
    while True:
        p = posterior(N, observations, RATE)
        best = max(range(N), key=lambda i: p[i])
        if p[best] >= CONFIDENCE or attempts >= CAP:
            return best == first_bad, attempts, choosing
        start = time.perf_counter()
        v = choose(p, RATE)
        choosing += time.perf_counter() - start
        fails, passes = observations.get(v, (0, 0))
        failed = v >= first_bad and draws[v][fails + passes] < RATE
        observations[v] = (fails + 1, passes) if failed else (fails, passes + 1)
        attempts += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1000, help="worlds for `now`")
    parser.add_argument("--alt-runs", type=int, default=200, help="worlds (the first of `now`'s) for the others")
    parser.add_argument("--seed", type=int, default=20261201)
    opts = parser.parse_args()
    searches: dict[str, Search] = {"now": next_version, "before": before, "two-step": two_step,
                                   "mi-ejs": mi_ejs, "confirm": confirm}  # fmt: skip
    results: dict[str, list[tuple[bool, int, float]]] = {name: [] for name in searches}
    for k in range(opts.runs):
        first_bad, draws = world(opts.seed + k)
        for name, choose in searches.items():
            if name == "now" or k < opts.alt_runs:
                results[name].append(search(choose, first_bad, draws))
    capacity, needed, floor = bound()
    title = f"probabilistic bisection search, Monte Carlo ({dt.date.today()}, tests/bench/bench_bisect_search.py)"
    lines = [f"\n## {title}\n",
             f"{N} versions, 40 % flake, confidence {CONFIDENCE}. Z-channel capacity {capacity:.4f} bit/attempt; "
             f"Fano: {needed:.3f} bits needed, so E[attempts] >= {floor:.1f} for any search.\n",
             f"| search | worlds | right | mean | median | p90 | max | share <= {BUDGET} | that^20 | ms/choice "
             "| paired mean diff vs now |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, rows in results.items():
        cells = sorted(r[1] for r in rows)
        share = sum(c <= BUDGET for c in cells) / len(cells)
        ms = 1000 * sum(r[2] for r in rows) / max(1, sum(cells))
        diffs = [r[1] - base[1] for r, base in zip(rows, results["now"], strict=False)]
        error = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
        paired = "" if name == "now" else f"{statistics.mean(diffs):+.2f} ± {error:.2f}"
        lines.append(f"| {name} | {len(rows)} | {100 * sum(r[0] for r in rows) / len(rows):.1f} % | "
                     f"{statistics.mean(cells):.2f} | {statistics.median(cells):g} | {cells[int(0.9 * len(cells))]} | "
                     f"{cells[-1]} | {100 * share:.1f} % | {share ** 20:.1e} | {ms:.2f} | {paired} |")  # fmt: skip
    report = "\n".join(lines) + "\n"
    print(report)
    append_section(report)


if __name__ == "__main__":
    main()
