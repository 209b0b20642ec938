"""Benchmark: the HTML report for 100,000 attempts across 200 runtime versions.

A synthetic catalog (one backend, --versions runtimes, --cases cases) is synced into a new SQLite
database through the real catalog code; then attempt rows are inserted with the models' table in bulk:
every case on every version once (a mix of passes, validation failures with two failed checks,
timeouts and skips, with ports, peaks, components, u64 worker ids and a completion excerpt), plus a
failed first attempt and a flaky passing retry for 1 in 49 cells, spread over --campaigns campaigns,
for --rows rows in all.

`write_report` then runs in a fresh child process, so its peak RSS (`resource.getrusage`) is the
report's and not the set-up's; the baseline after imports is reported next to it. The same is done on
a small database (the seed catalog and a few attempts), which is what `matrix run` refreshes.
Run: python tests/bench/bench_report.py [--cases 490] [--versions 200]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

TARGET_S = 10.0
BACKEND = "vllm"
MARKERS = [("pre_merge", "lifecycle"), ("nightly", "lifecycle"), ("gpu_1", "hardware"), ("e2e", "kind")]


def versions(n: int) -> list[str]:
    """n PEP 440 versions with release candidates and dev builds among them, oldest first."""
    found = []
    for i in range(n):
        minor, patch = 10 + i // 10, i % 10
        if i % 11 == 5:
            found.append(f"0.{minor}.{patch}rc1")
        elif i % 13 == 7:
            found.append(f"0.{minor}.{patch}rc1.dev{100 + i}+g{i:07x}")
        else:
            found.append(f"0.{minor}.{patch}")
    return found


def make_database(path: Path, n_cases: int, n_versions: int, n_campaigns: int, seed: int) -> int:
    """Create and fill the database; return the number of attempt rows."""
    from sqlalchemy import insert, select

    from matrix.catalog.spec import BackendSpec, CaseSpec, CatalogSpec, FixSpec, MarkerSpec, RuntimeSpec
    from matrix.catalog.sync import sync_catalog
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.db.models import Campaign, Case, CellRun, Runtime

    rng = random.Random(seed)
    engine = create_db_engine(f"sqlite:///{path}")
    ensure_schema(engine)
    spec = CatalogSpec(
        backends=[BackendSpec(BACKEND)],
        markers=[MarkerSpec(name, kind) for name, kind in MARKERS],
        fixes=[FixSpec("vllm#54814", "vllm-rs", ["0.15.1rc0", "0.16.0"], link="https://example.org/pull/54814")],
        runtimes=[
            RuntimeSpec(BACKEND, v, f"v{v}", "release", {"kind": "host"}, {"vllm": v, "vllm-rs": v})
            for v in versions(n_versions)
        ],
        cases=[
            CaseSpec(
                name=f"case_{i:03d}",
                backend=BACKEND,
                arm="dynamo",
                model="Qwen/Qwen3-0.6B",
                markers=[rng.choice(["pre_merge", "nightly"]), "gpu_1", "e2e"],
                requires_fixes=["vllm#54814"] if i % 7 == 0 else [],
            )
            for i in range(n_cases)
        ],
        kinds={"backend", "runtime", "marker", "fix", "case"},
    )
    factory = session_factory(engine)
    with transaction(factory) as session:
        sync_catalog(session, spec)
    with transaction(factory) as session:
        case_ids = list(session.scalars(select(Case.id).order_by(Case.name)))
        runtime_ids = list(session.scalars(select(Runtime.id).order_by(Runtime.id)))
        start = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
        campaign_ids = []
        for c in range(n_campaigns):
            row = Campaign(status="finished", host=f"gpu-host-{c % 3}", git_sha=f"{c:012x}", started_at=start,
                           finished_at=start + dt.timedelta(hours=1), selection={"backends": [BACKEND]})  # fmt: skip
            session.add(row)
            session.flush()
            campaign_ids.append(row.id)
        rows: list[dict[str, Any]] = []
        count = 0
        uid = 0
        for v_index, runtime_id in enumerate(runtime_ids):
            campaign_id = campaign_ids[v_index * n_campaigns // len(runtime_ids)]
            for case_id in case_ids:
                roll = rng.random()
                flaky = (v_index * len(case_ids) + case_id) % 49 == 0  # 1 in 49 cells: 100,000 rows at 98,000
                attempts = [("failed", 1), ("passed", 2)] if flaky else [(_status(roll), 1)]
                for status, attempt in attempts:
                    uid += 1
                    rows.append(_row(rng, uid, campaign_id, case_id, runtime_id, status, attempt, flaky, start))
                if len(rows) >= 5000:
                    session.execute(insert(CellRun.__table__), rows)
                    count += len(rows)
                    rows = []
        if rows:
            session.execute(insert(CellRun.__table__), rows)
            count += len(rows)
    engine.dispose()
    return count


def _status(roll: float) -> str:
    if roll < 0.87:
        return "passed"
    if roll < 0.95:
        return "failed"
    return "timeout" if roll < 0.98 else "skipped"


def _row(
    rng: random.Random, uid: int, campaign: int, case: int, runtime: int, status: str, attempt: int, flaky: bool,
    start: dt.datetime,
) -> dict[str, Any]:  # fmt: skip
    served = status in ("passed", "failed")
    ready = rng.uniform(20, 60) if status != "skipped" else None
    row: dict[str, Any] = {
        "uid": f"{uid:013x}", "campaign_id": campaign, "case_id": case, "runtime_id": runtime, "attempt": attempt,
        "status": status, "flaky": flaky and attempt == 2, "started_at": start, "finished_at": start,
        "owner_host": "gpu-host", "ready_s": ready, "request_s": rng.uniform(0.5, 3) if served else None,
        "total_s": (ready or 0) + 5 if status != "skipped" else None, "teardown_s": 2.0 if served else None,
        "checks": [], "message": "", "expected_failure": "", "unexpected_pass": False, "completion_excerpt": "",
        "ports": {}, "exit_codes": {}, "gpu": {}, "peaks": {}, "components": {}, "log_dir": "",
        "failure_kind": None, "prefill_worker_id": None, "decode_worker_id": None, "prompt_tokens": None,
        "completion_tokens": None, "finish_reason": None,
    }  # fmt: skip
    if served:
        row |= {
            "prefill_worker_id": str(rng.getrandbits(64)), "decode_worker_id": str(rng.getrandbits(64)),
            "prompt_tokens": 91, "completion_tokens": 64, "finish_reason": "length",
            "completion_excerpt": "meadow victor papa slate zulu drift ember nectar harbor quartz " * 3,
            "ports": {"frontend": 30000 + uid % 1000, "prefill_http": 31000, "decode_http": 32000,
                      "prefill_side_channel": 33000, "decode_side_channel": 34000},
            "exit_codes": {"prefill": 0, "decode": 0, "frontend": 0},
            "gpu": {"cuda_visible_devices": "0", "uuid": "GPU-ccb6b08d"},
            "peaks": {"rss_bytes": {"prefill": 2_400_000_000, "decode": 2_300_000_000}, "gpu_bytes": 3_430_000_000},
            "components": {"vllm": "0.29.0", "vllm-rs": "0.29.0"},
        }  # fmt: skip
    if status == "failed":
        row |= {
            "failure_kind": "startup" if attempt == 1 and flaky else "validation",
            "checks": [] if flaky else [
                {"name": "worker_ids_distinct", "message": "prefill_worker_id and decode_worker_id are both 7"},
                {"name": "completion_tokens", "message": "completion_tokens is 1, expected more than 1"},
            ],
            "message": "prefill exited with code 1 before it was ready" if flaky else "",
        }  # fmt: skip
    elif status == "timeout":
        row |= {"failure_kind": "health", "message": "not healthy within 300 s"}
    elif status == "skipped":
        row |= {"message": "needs 1 GPU, host has 0"}
    return row


def child(db: str, out: str) -> None:
    """Runs in a fresh process: time write_report, report the peak RSS."""
    from matrix.db.engine import create_db_engine, session_factory
    from matrix.report import write_report
    from matrix.report.render import environment

    environment()  # imports and template loading belong to the baseline, not to the report
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine = create_db_engine(f"sqlite:///{db}")
    started, cpu = time.perf_counter(), time.process_time()
    with session_factory(engine)() as session:
        write_report(session, Path(out))
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "baseline_kb": baseline_kb, "peak_kb": peak_kb}))


def measure(db: Path, out: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, __file__, "--child", str(db), str(out)], capture_output=True, text=True, check=True
    )
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    files = list(out.iterdir())
    data["files"] = len(files)
    data["bytes"] = sum(f.stat().st_size for f in files)
    data["index_bytes"] = (out / "index.html").stat().st_size
    data["largest_bytes"] = max(f.stat().st_size for f in files)
    return data


def small_database(path: Path) -> int:
    """The seed catalog with a handful of attempts: what `matrix run` refreshes the report for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MATRIX_DB": str(path), "MATRIX_HOME": str(path.parent)}
    subprocess.run([sys.executable, "-m", "matrix", "catalog", "sync"], env=env, check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "matrix", "run", "--backend", "reference", "-q"], env=env, check=False,
                   capture_output=True)  # fmt: skip
    with sqlite3.connect(path) as conn:
        (count,) = conn.execute("SELECT count(*) FROM cell_run").fetchone()
    return int(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=490)
    parser.add_argument("--versions", type=int, default=200)
    parser.add_argument("--campaigns", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-append", action="store_true", help="Print only; do not append to docs/benchmarks.md.")
    parser.add_argument("--child", nargs=2, metavar=("DB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-report-"))
    try:
        started = time.perf_counter()
        rows = make_database(work / "big.db", args.cases, args.versions, args.campaigns, args.seed)
        setup_s = time.perf_counter() - started
        big = measure(work / "big.db", work / "big")
        small_rows = small_database(work / "small" / "matrix.db")
        small = measure(work / "small" / "matrix.db", work / "small-report")
        load = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = 1024
    verdict = "Met" if big["seconds"] < TARGET_S else "NOT met"
    cells = args.cases * args.versions
    text = f"""
## HTML report at 100,000 attempts (`write_report`, {dt.date.today().isoformat()}, {os.cpu_count()} cores)

`python tests/bench/bench_report.py --cases {args.cases} --versions {args.versions}`

{args.cases} cases x {args.versions} versions of one backend = {cells:,} cells and {rows:,} attempt rows (1 in 49
cells has a failed first attempt and a flaky passing retry) in {args.campaigns} campaigns, inserted in bulk into
a new SQLite database ({setup_s:.1f} s of set-up, not timed). `write_report` runs in a fresh process; peak RSS
is `ru_maxrss` after the report, next to the same process's baseline after imports (Jinja2 and the templates
loaded).

| database | attempts | pages | output | index page | largest page | wall, s | CPU, s | peak RSS (baseline), MiB |
|---|---|---|---|---|---|---|---|---|
| synthetic | {rows:,} | {big["files"]} | {big["bytes"] / 2**20:.0f} MiB | {big["index_bytes"] / 2**20:.1f} MiB | {big["largest_bytes"] / 2**20:.1f} MiB | **{big["seconds"]:.2f}** | {big["cpu_s"]:.2f} | {big["peak_kb"] / mib:.0f} ({big["baseline_kb"] / mib:.0f}) |
| seed catalog after `matrix run --backend reference` | {small_rows} | {small["files"]} | {small["bytes"] / 1024:.0f} KiB | {small["index_bytes"] / 1024:.0f} KiB | {small["largest_bytes"] / 1024:.0f} KiB | {small["seconds"]:.3f} | {small["cpu_s"]:.3f} | {small["peak_kb"] / mib:.0f} ({small["baseline_kb"] / mib:.0f}) |

Load average over the last minute when the report ran: {load:.1f} on {os.cpu_count()} cores (the wall time counts
waiting for the CPU; the CPU time does not).

Target: under {TARGET_S:.0f} s with bounded memory. {verdict}. The attempt summaries the grid needs are read in one query
(about 100 bytes each); each runtime page reads its own full rows (one query per page) and is streamed to
disk cell by cell, so memory holds the summaries plus one runtime's rows, never every full row at once.
"""  # noqa: E501
    print(text)
    if not args.no_append:
        append_section(text)


if __name__ == "__main__":
    main()
