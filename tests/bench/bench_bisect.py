"""Benchmark: `matrix bisect` over 64 synthetic reference runtimes with a planted break, real cells.

Each runtime is the built-in reference server; from a version drawn by the seed on, its provider env
plants a fault (`crash-at-start`: a deterministic break; `flaky-start` at MATRIX_REFERENCE_FLAKE_RATE=0.4:
a flaky one). `matrix bisect` runs as a real process on a fresh database per seed; we record the cells it
ran, whether it named the planted version, and the wall time.

Run: python tests/bench/bench_bisect.py [--seeds 5] [--flaky-seeds 2]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

N = 64


def catalog(path: Path, break_at: int, flaky: bool) -> None:
    lines = ['[[backend]]\nname = "synth"\n']
    for i in range(N):
        env = ""
        if i >= break_at:
            env = (', env = { MATRIX_REFERENCE_FAULTS = "flaky-start", MATRIX_REFERENCE_FLAKE_RATE = "0.4" }'
                   if flaky else ', env = { MATRIX_REFERENCE_FAULTS = "crash-at-start" }')  # fmt: skip
        lines.append(f'[[runtime]]\nbackend = "synth"\nversion = "1.{i}.0"\nprovider = {{ kind = "builtin"{env} }}\n')
    lines.append('[[case]]\nname = "synth_pair"\nbackend = "synth"\narm = "reference"\nmodel = "tiny"\n'
                 'markers = ["gpu_0"]\nstartup_timeout_s = 20\nrequest_timeout_s = 10\n'
                 'launch = { teardown_grace_s = 0.5 }\n')  # fmt: skip
    path.write_text("\n".join(lines))


def run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MATRIX_HOME": str(home), "MATRIX_DB": str(home / "matrix.db")}
    return subprocess.run([sys.executable, "-m", "matrix", *args], env=env, capture_output=True, text=True,
                          check=False, timeout=3600)  # fmt: skip


def one(seed: int, flaky: bool) -> dict[str, object]:
    break_at = random.Random(seed).randrange(1, N)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        catalog(home / "synth.toml", break_at, flaky)
        sync = run(home, "catalog", "sync", str(home / "synth.toml"), str(REPO / "data" / "markers.toml"))
        assert sync.returncode == 0, sync.stderr
        args = ["bisect", "synth_pair", "--between", "1.0.0", f"1.{N - 1}.0", "--json"]
        if flaky:
            args += ["--flaky", "0.4", "--confidence", "0.95"]
        start = time.perf_counter()
        result = run(home, *args)
        wall = time.perf_counter() - start
    data = json.loads(result.stdout)
    return {"seed": seed, "planted": f"1.{break_at}.0", "found": data["first"], "cells": data["attempts"],
            "wall_s": wall, "confidence": data.get("confidence")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--flaky-seeds", type=int, default=2)
    opts = parser.parse_args()
    rows = [one(seed, False) for seed in range(opts.seeds)]
    rows += [one(100 + seed, True) for seed in range(opts.flaky_seeds)]
    lines = [f"\n## bisect over {N} reference runtimes ({dt.date.today()}, tests/bench/bench_bisect.py)\n",
             "| break | seed | planted | found | cells | wall s | confidence |", "|---|---|---|---|---|---|---|"]
    for r, kind in zip(rows, ["deterministic"] * opts.seeds + ["40 % flaky"] * opts.flaky_seeds, strict=True):
        conf = f"{r['confidence']:.3f}" if r["confidence"] is not None else ""
        lines.append(
            f"| {kind} | {r['seed']} | {r['planted']} | {r['found']} | {r['cells']} | {r['wall_s']:.1f} | {conf} |"
        )
    det = rows[: opts.seeds]
    lines.append(f"\ndeterministic: max {max(int(str(r['cells'])) for r in det)} cells (bound 7), "
                 f"median wall {statistics.median(float(str(r['wall_s'])) for r in det):.1f} s\n")  # fmt: skip
    report = "\n".join(lines)
    print(report)
    append_section(report)


if __name__ == "__main__":
    main()
