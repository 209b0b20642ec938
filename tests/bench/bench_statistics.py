"""Benchmark: error rates of `matrix compare`'s regression flag, on real reference samples and on seeded ones.

Real samples: three builtin runtimes of one synthetic backend run the same reference case with
`matrix run --repeat R` (real processes, CLI, database): `1.0.0` and `1.0.1` are identical (A/A), `1.1.0`
plants `slow-request` (+15 % request latency). From the stored request times, 100 trials each draw N
samples per side without replacement and apply the regression rule (Mann-Whitney p < alpha AND ratio of
medians past the threshold):

* false positives: 1.0.0 against 1.0.1 (nothing planted) flagged;
* false negatives: 1.0.0 against 1.1.0 (+15 % planted) not flagged.

Seeded samples: the same rule on lognormal samples (sigma 0.1) with a seeded RNG, 1000 trials each, A/A
and +15 %, as the pure-statistics reference.

Runs are one campaign for the three runtimes, so their repeats interleave (`--sequential`: one campaign per
runtime, one after the other, to measure what host-load drift does to an A/B comparison).

Run: python tests/bench/bench_statistics.py [--repeat 60] [--n 30] [--trials 100] [--sequential]
(appends to docs/benchmarks.md; docs/statistics.md quotes it)
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from matrix.report.perf import compare_metrics  # noqa: E402
from tests.bench.results import append_section  # noqa: E402

THRESHOLD, ALPHA = 0.10, 0.01
CATALOG = """
[[backend]]
name = "synth"

[[runtime]]
backend = "synth"
version = "1.0.0"
provider = { kind = "builtin" }

[[runtime]]
backend = "synth"
version = "1.0.1"
provider = { kind = "builtin" }

[[runtime]]
backend = "synth"
version = "1.1.0"
provider = { kind = "builtin", env = { MATRIX_REFERENCE_FAULTS = "slow-request" } }

[[case]]
name = "ref_timed"
backend = "synth"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 20
request_timeout_s = 10
payload = { max_tokens = 16 }
launch = { token_delay_ms = 5, teardown_grace_s = 0.5 }
"""


def matrix(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MATRIX_HOME": str(home), "MATRIX_DB": str(home / "matrix.db")}
    return subprocess.run([sys.executable, "-m", "matrix", *args], env=env, capture_output=True, text=True,
                          check=False, timeout=3600)  # fmt: skip


def real_samples(repeat: int, interleaved: bool) -> tuple[dict[str, list[float]], float]:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        (home / "synth.toml").write_text(CATALOG)
        sync = matrix(home, "catalog", "sync", str(home / "synth.toml"), str(REPO / "data" / "markers.toml"))
        assert sync.returncode == 0, sync.stderr
        start = time.perf_counter()
        if interleaved:  # one campaign: the repeats of the three runtimes take turns
            runs = [["--runtime", "synth=1.0.0", "--runtime", "synth=1.0.1", "--runtime", "synth=1.1.0"]]
        else:  # one campaign per runtime, one after the other
            runs = [["--runtime", f"synth={version}"] for version in ("1.0.0", "1.0.1", "1.1.0")]
        for chosen in runs:
            run = matrix(home, "run", *chosen, "--repeat", str(repeat), "--no-report", "-q", "-j", "2")
            assert run.returncode == 0, run.stdout + run.stderr
        wall = time.perf_counter() - start
        with sqlite3.connect(home / "matrix.db") as conn:
            rows = conn.execute(
                "SELECT runtime.version, cell_run.request_s FROM cell_run JOIN runtime ON runtime.id = "
                "cell_run.runtime_id WHERE cell_run.status = 'passed' ORDER BY cell_run.id"
            ).fetchall()
    samples: dict[str, list[float]] = {}
    for version, request in rows:
        samples.setdefault(version, []).append(float(request))
    return samples, wall


def flagged(a: list[float], b: list[float]) -> tuple[bool, bool]:
    """(regression under the rule, significant at alpha whatever the size)."""
    (verdict,) = compare_metrics({"request_s": a}, {"request_s": b}, THRESHOLD, ALPHA)
    return verdict.regression, verdict.comparison.significant(ALPHA)


def trials(a: list[float], b: list[float], n: int, count: int, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    regressions = significant = 0
    for _ in range(count):
        regression, sig = flagged(rng.sample(a, n), rng.sample(b, n))
        regressions += regression
        significant += sig
    return regressions, significant


def seeded(n: int, count: int, factor: float, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    regressions = significant = 0
    for _ in range(count):
        a = [math.exp(rng.gauss(0, 0.1)) for _ in range(n)]
        b = [factor * math.exp(rng.gauss(0, 0.1)) for _ in range(n)]
        regression, sig = flagged(a, b)
        regressions += regression
        significant += sig
    return regressions, significant


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=60, help="real attempts per runtime")
    parser.add_argument("--n", type=int, default=30, help="samples per side in each trial")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--sequential", action="store_true", help="one campaign per runtime instead of one for all")
    opts = parser.parse_args()
    samples, wall = real_samples(opts.repeat, not opts.sequential)
    a, a2, b = samples["1.0.0"], samples["1.0.1"], samples["1.1.0"]
    median = {v: sorted(s)[len(s) // 2] for v, s in samples.items()}
    full = compare_metrics({"request_s": a[: opts.n]}, {"request_s": b[: opts.n]}, THRESHOLD, ALPHA)[0]
    aa_reg, aa_sig = trials(a, a2, opts.n, opts.trials, 1)
    # One runtime against itself: two disjoint random halves of its own samples, per trial.
    self_reg = self_sig = 0
    rng = random.Random(5)
    for _ in range(opts.trials):
        shuffled = rng.sample(a, len(a))
        regression, sig = flagged(shuffled[: opts.n], shuffled[opts.n : 2 * opts.n])
        self_reg += regression
        self_sig += sig
    ab_reg, ab_sig = trials(a, b, opts.n, opts.trials, 2)
    s_aa_reg, s_aa_sig = seeded(opts.n, 1000, 1.0, 3)
    s_ab_reg, _ = seeded(opts.n, 1000, 1.15, 4)
    how = "one campaign per runtime, one after the other" if opts.sequential else "one campaign, repeats interleaved"
    lines = [
        f"\n## compare: regression flag error rates ({dt.date.today()}, tests/bench/bench_statistics.py)\n",
        f"Rule: Mann-Whitney p < {ALPHA} and ratio of medians past {THRESHOLD:.0%}; N = {opts.n} per side.",
        f"Runs: {how}. "
        f"Real reference samples: {opts.repeat} passed attempts per runtime ({len(a)}/{len(a2)}/{len(b)} passed), "
        f"{wall:.0f} s of runs; median request time 1.0.0 {median['1.0.0'] * 1000:.1f} ms, 1.0.1 "
        f"{median['1.0.1'] * 1000:.1f} ms, 1.1.0 (+15 % planted) {median['1.1.0'] * 1000:.1f} ms.\n",
        "| comparison | samples | trials | flagged as regression | significant at p < 0.01 |",
        "|---|---|---|---|---|",
        f"| A/A (1.0.0 vs 1.0.1) | real | {opts.trials} | {aa_reg} (false-positive rate {aa_reg / opts.trials:.0%}) "
        f"| {aa_sig} |",
        f"| A/A (1.0.0 split in halves) | real | {opts.trials} | {self_reg} (false-positive rate "
        f"{self_reg / opts.trials:.0%}) | {self_sig} |",
        f"| +15 % (1.0.0 vs 1.1.0) | real | {opts.trials} | {ab_reg} (false-negative rate "
        f"{1 - ab_reg / opts.trials:.0%}) | {ab_sig} |",
        f"| A/A | seeded lognormal | 1000 | {s_aa_reg} ({s_aa_reg / 10:.1f} %) | {s_aa_sig} |",
        f"| +15 % | seeded lognormal | 1000 | {s_ab_reg} (false-negative rate {100 - s_ab_reg / 10:.1f} %) | |",
        f"\nFirst {opts.n} real attempts per side, 1.0.0 vs 1.1.0: {full.text()}\n",
    ]
    report = "\n".join(lines)
    print(report)
    append_section(report)


if __name__ == "__main__":
    main()
