"""Benchmark: CI fan-out at 10,000 cells (plan into 256 shards) and the import of 1,000 attempts.

The synthetic catalog of `bench_plan_scale.py` (100 cases x 100 runtimes = 10,000 cells) is synced
into a new SQLite database, then:

* `matrix plan --format github-matrix` (default --max-jobs 256) runs as a real process, end to end
  (interpreter start, imports, load the rows, plan, shard, print); and its in-process parts: planning
  from the database plus reading history, and the sharding plus JSON encoding alone;
* shard balance (longest shard / mean shard, in expected seconds) with the catalog's timeouts as the
  expected durations (no history), and with a history of median durations per case drawn from a
  log-normal distribution (what a real database gives after a few campaigns);
* a runner database gets one campaign of --rows attempts (the first cells of the plan, 1 in 10
  failed) with three role logs of 40 KiB each, and `write_results` writes the shard file (log tails
  cut to 16 KiB, 4 KiB for a passed attempt);
  a fresh central database imports it with `matrix import` (a real process, end to end), then imports
  it again (every attempt already present, nothing written).

Run: python tests/bench/bench_fanout.py [--rows 1000]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.bench_plan_scale import median_time, synthetic_catalog  # noqa: E402
from tests.bench.results import append_section  # noqa: E402

LOG_BYTES = 40 * 1024
ROLES = ("frontend", "prefill", "decode")


def run_cli(home: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    env = {**os.environ, "MATRIX_HOME": str(home), "MATRIX_DB": str(home / "matrix.db")}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "matrix", *args], env=env, capture_output=True, text=True, check=False, timeout=600
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"matrix {' '.join(args)} failed: {result.stderr}")
    return elapsed, result


def new_db(home: Path, spec: Any) -> Any:
    from matrix.catalog.sync import sync_catalog
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema

    home.mkdir(parents=True, exist_ok=True)
    engine = create_db_engine(f"sqlite:///{home / 'matrix.db'}")
    ensure_schema(engine)
    factory = session_factory(engine)
    with transaction(factory) as session:
        sync_catalog(session, spec)
    return engine, factory


def balance(cells: Any, expected: dict[str, float]) -> tuple[int, float, float, float]:
    from matrix.fanout.shards import shard_cells

    shards = shard_cells(cells, expected, 256)
    loads = [s.expected_s for s in shards]
    mean = statistics.fmean(loads)
    return len(shards), max(loads), mean, min(loads)


def fill_runner(factory: Any, cells: Any, rows: int, logs_root: Path, seed: int) -> int:
    """One finished campaign with `rows` attempts and their role logs; returns the campaign id."""
    from matrix.db.engine import transaction
    from matrix.db.models import Campaign, CellRun

    rng = random.Random(seed)
    now = dt.datetime.now(dt.UTC)
    line = "2026-11-30T12:00:00.000+00:00 [worker] step ok tokens=64 kv_blocks=12 latency_ms=3.2\n"
    log_text = (line * (LOG_BYTES // len(line) + 1))[:LOG_BYTES]
    with transaction(factory) as session:
        campaign = Campaign(status="finished", selection={"cells": [c.key for c in cells[:rows]],
                            "campaign_key": "bench:1"}, host="runner-1", executor="local", git_sha="0123456789ab",
                            matrix_version="0.1.0", started_at=now, finished_at=now)  # fmt: skip
        session.add(campaign)
        session.flush()
        for i, cell in enumerate(cells[:rows]):
            uid = f"c{i:012x}"
            log_dir = logs_root / f"cell-{uid}"
            log_dir.mkdir(parents=True)
            for role in ROLES:
                (log_dir / f"{role}.log").write_text(log_text)
            failed = rng.random() < 0.1
            session.add(
                CellRun(
                    uid=uid, campaign_id=campaign.id, case_id=cell.case.id, runtime_id=cell.runtime.id, attempt=1,
                    status="failed" if failed else "passed", failure_kind="validation" if failed else None,
                    message="content_nonblank: empty completion" if failed else "",
                    checks=[{"name": "content_nonblank", "message": "empty"}] if failed else [],
                    started_at=now, finished_at=now, owner_host="runner-1", ready_s=rng.uniform(20, 90),
                    request_s=rng.uniform(0.1, 2), ttft_s=0.05, teardown_s=1.5, total_s=rng.uniform(25, 100),
                    prefill_worker_id=str(rng.getrandbits(64)), decode_worker_id=str(rng.getrandbits(64)),
                    prompt_tokens=91, completion_tokens=64, finish_reason="length", completion_excerpt="x " * 100,
                    ports={"frontend": 30000 + i % 1000, "prefill_http": 31000, "decode_http": 32000},
                    exit_codes={r: 0 for r in ROLES}, log_dir=str(log_dir), gpu={"indices": [0]},
                    peaks={"rss_bytes": {r: 2**30 for r in ROLES}}, components={"vllm": "0.30.0"},
                )
            )  # fmt: skip
        return int(campaign.id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--runtimes", type=int, default=100)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="matrix-bench-fanout-"))
    os.environ["MATRIX_HOME"] = str(root / "planner")
    from matrix.campaign import expected_durations
    from matrix.catalog.queries import plan_from_db
    from matrix.db.engine import transaction
    from matrix.fanout.shard_results import write_results
    from matrix.fanout.shards import expected_seconds, github_matrix, shard_cells
    from matrix.plan import Selection

    spec = synthetic_catalog(args.cases, args.runtimes, args.seed)
    planner = root / "planner"
    engine, factory = new_db(planner, spec)

    cli_times, out = [], None
    for _ in range(args.repeat):
        elapsed, out = run_cli(planner, "plan", "--format", "github-matrix")
        cli_times.append(elapsed)
    assert out is not None
    cli_s = statistics.median(cli_times)
    matrix_json = out.stdout.strip()
    entries = json.loads(matrix_json)["include"]
    n_cells = sum(e["count"] for e in entries)

    def from_db() -> Any:
        with transaction(factory) as session:
            return plan_from_db(session, Selection()), expected_durations(session)

    db_s, (plan, history) = median_time(from_db, args.repeat)
    expected = {c.key: expected_seconds(c, history) for c in plan.cells}
    shard_s, _ = median_time(
        lambda: json.dumps(github_matrix(shard_cells(plan.cells, expected, 256)), separators=(",", ":")), args.repeat
    )
    shards, top, mean, low = balance(plan.cells, expected)
    rng = random.Random(args.seed)
    medians = {case.id: rng.lognormvariate(4.0, 0.8) for case in {c.case.id: c.case for c in plan.cells}.values()}
    h_expected = {c.key: expected_seconds(c, medians) for c in plan.cells}
    _, h_top, h_mean, h_low = balance(plan.cells, h_expected)

    runner = root / "runner"
    _, runner_factory = new_db(runner, spec)
    with transaction(runner_factory) as session:
        runner_plan = plan_from_db(session, Selection())
    campaign_id = fill_runner(runner_factory, runner_plan.cells, args.rows, runner / "runs", args.seed)
    results = root / "shard.json"
    start = time.perf_counter()
    with transaction(runner_factory) as session:
        written = write_results(session, campaign_id, results, "bench:1")
    write_s = time.perf_counter() - start
    assert written == args.rows
    size = results.stat().st_size

    firsts, agains, baselines = [], [], []
    for i in range(args.repeat):
        central = root / f"central-{i}"
        new_db(central, spec)[0].dispose()
        import_s, first = run_cli(central, "import", str(results))
        again_s, second = run_cli(central, "import", str(results))
        assert f"{args.rows} attempts imported" in first.stdout, first.stdout
        assert f"0 attempts imported, {args.rows} already present" in second.stdout, second.stdout
        baseline_s, _ = run_cli(central, "db", "current")  # interpreter start + imports + schema check
        firsts.append(import_s)
        agains.append(again_s)
        baselines.append(baseline_s)
    import_s, again_s, baseline_s = (statistics.median(t) for t in (firsts, agains, baselines))
    load = os.getloadavg()[0]

    engine.dispose()
    shutil.rmtree(root, ignore_errors=True)

    report = (
        f"\n## CI fan-out: 10,000 cells into 256 shards, import of {args.rows:,} attempts "
        f"({dt.date.today()}, {os.cpu_count()} cores)\n\n"
        f"`python tests/bench/bench_fanout.py --rows {args.rows}`\n\n"
        f"The synthetic catalog of `bench_plan_scale.py` ({args.cases} cases x {args.runtimes} runtimes) in a new "
        f"SQLite database. Medians of {args.repeat} runs; processes timed from spawn to exit.\n\n"
        "| what | ms |\n|---|---|\n"
        f"| `matrix plan --format github-matrix`, a process end to end ({n_cells:,} cells -> {len(entries)} shards) "
        f"| {cli_s * 1000:.0f} |\n"
        f"| of which: `plan_from_db` + history query | {db_s * 1000:.0f} |\n"
        f"| of which: LPT sharding + JSON encoding | {shard_s * 1000:.0f} |\n"
        f"| `write_results`: {args.rows:,} attempts, 3 role logs of 40 KiB each (tails: 16 KiB, 4 KiB when passed) "
        f"-> {size / 2**20:.1f} MiB file | {write_s * 1000:.0f} |\n"
        f"| `matrix import` of that file into a fresh database, a process end to end | {import_s * 1000:.0f} |\n"
        f"| `matrix import` of the same file again (all present, nothing written) | {again_s * 1000:.0f} |\n"
        f"| for scale: `matrix db current`, a process end to end (start-up + schema check) "
        f"| {baseline_s * 1000:.0f} |\n\n"
        f"Matrix JSON: {len(matrix_json.encode()) / 1024:.0f} KiB on one line (GitHub allows 1 MiB per job "
        "output).\n\n"
        "| expected durations | shards | longest shard, s | mean, s | shortest, s | longest / mean |\n"
        "|---|---|---|---|---|---|\n"
        f"| the cases' timeouts (no history) | {shards} | {top:.0f} | {mean:.0f} | {low:.0f} | {top / mean:.3f} |\n"
        f"| history: log-normal medians per case (median 55 s) | {shards} | {h_top:.0f} | {h_mean:.0f} | "
        f"{h_low:.0f} | {h_top / h_mean:.3f} |\n\n"
        f"Load average over the last minute at the end: {load:.1f} on {os.cpu_count()} cores (the host is shared, "
        "so process times include waiting for a CPU).\n"
    )
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
