"""Benchmark: one campaign of reference cells run by one runner vs shared by two (`matrix run --join`).

16 cases (by default), each a real reference pair whose workers wait `slow_start_s` (1 s) before
listening, so a cell takes about 1.3 s and the runners mostly wait, as they do on real engines. For
each database (SQLite file; PostgreSQL when MATRIX_TEST_POSTGRES_URL or --postgres-url is set, each
configuration in a fresh database created through that URL), through the real CLI:

* one runner, `--jobs J`;
* one runner, `--jobs 2J` (the same slot count as two runners, on one host);
* two runners, `--jobs J` each: the owner, and a joiner (`--join 1`) started as soon as the campaign
  row exists.

Reported from the database: makespan (campaign `finished_at - started_at`, so the joiner's own start-up
counts), cells each runner ran, and whether every cell has exactly one attempt (it must). The speedup
of two runners over one runner with J slots shows what a joining host adds; the comparison with one
runner on 2J slots shows what sharing costs (claims, the joiner's start-up) against more slots on one
host. All runners here share one host with few cores, so this measures the protocol, not more hardware.
Run: python tests/bench/bench_shared_campaign.py [--cells 16] [--jobs 2]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

SEED_FILES = ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")


@dataclass
class Result:
    database: str
    label: str
    makespan_s: float
    per_runner: list[int]
    exactly_once: bool


def write_catalog(directory: Path, cells: int, wait_s: float) -> list[str]:
    lines = []
    for i in range(cells):
        lines += [
            "[[case]]",
            f'name = "shared_{i:02d}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0", "e2e"]',
            "startup_timeout_s = 60\nrequest_timeout_s = 10",
            f'launch = {{ faults = ["slow-start"], slow_start_s = {wait_s} }}',
            "",
        ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "shared.toml").write_text("\n".join(lines))
    return [str(directory / "shared.toml")] + [str(REPO / "data" / name) for name in SEED_FILES]


@contextmanager
def fresh_database(kind: str, admin_url: str | None, home: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{home / 'matrix.db'}"
        return
    assert admin_url is not None
    name = f"matrix_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _seconds(value: object) -> float:
    moment = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value))
    return moment.replace(tzinfo=moment.tzinfo or dt.UTC).timestamp()


def run_configuration(
    kind: str, admin_url: str | None, label: str, runners: int, jobs: int, cells: int, wait_s: float
) -> Result:
    home = Path(tempfile.mkdtemp(prefix="matrix-bench-shared-"))
    try:
        with fresh_database(kind, admin_url, home) as url:
            env = {**os.environ, "MATRIX_HOME": str(home), "MATRIX_DB": url}
            matrix = [sys.executable, "-m", "matrix"]
            files = write_catalog(home / "catalog", cells, wait_s)
            subprocess.run([*matrix, "catalog", "sync", *files], env=env, check=True, capture_output=True)
            run = [*matrix, "run", "--quiet", "--no-report", "--jobs", str(jobs)]
            logs = [home / "runner-0.log", home / "runner-1.log"]
            procs = [
                subprocess.Popen(
                    [*run, "--backend", "reference"], env=env, stdout=logs[0].open("w"), stderr=subprocess.STDOUT
                )
            ]
            engine = create_engine(url)
            try:
                if runners == 2:
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        with engine.connect() as conn:
                            if conn.execute(text("SELECT count(*) FROM campaign")).scalar():
                                break
                        time.sleep(0.02)
                    joiner = subprocess.Popen(
                        [*run, "--join", "1"], env=env, stdout=logs[1].open("w"), stderr=subprocess.STDOUT
                    )
                    procs.append(joiner)
                for index, proc in enumerate(procs):
                    if proc.wait(timeout=600) != 0:
                        with engine.connect() as conn:
                            failed = conn.execute(
                                text("SELECT uid, status, failure_kind, message FROM cell_run WHERE status != 'passed'")
                            ).all()
                        raise SystemExit(
                            f"{label} on {kind}: runner {index} exited {proc.returncode}:\n"
                            f"{logs[index].read_text()[-3000:]}\nrows not passed: {failed}"
                        )
                with engine.connect() as conn:
                    started, finished = conn.execute(text("SELECT started_at, finished_at FROM campaign")).one()
                    by_owner = dict(
                        conn.execute(text("SELECT owner_pid, count(*) FROM cell_run GROUP BY owner_pid")).all()
                    )
                    attempts = conn.execute(
                        text("SELECT count(*), count(DISTINCT case_id) FROM cell_run WHERE status = 'passed'")
                    ).one()
            finally:
                engine.dispose()
        return Result(
            database=kind,
            label=label,
            makespan_s=_seconds(finished) - _seconds(started),
            per_runner=[int(by_owner.get(proc.pid, 0)) for proc in procs],
            exactly_once=tuple(attempts) == (cells, cells),
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)


def report(results: list[Result], cells: int, jobs: int, wait_s: float) -> str:
    today = dt.date.today().isoformat()
    lines = [
        "",
        f"## Shared campaign: one runner vs two (`--join`), {cells} reference cells ({today}, {os.cpu_count()} cores)",
        "",
        f"Each cell is a reference pair whose workers wait {wait_s} s before listening. Makespan is the "
        "campaign's `finished_at - started_at` (the joiner's start-up included); runners share one host.",
        "`python tests/bench/bench_shared_campaign.py` (PostgreSQL through `MATRIX_TEST_POSTGRES_URL`).",
        "",
        "| database | runners | makespan | cells per runner | every cell once | speedup vs 1 runner, J slots |",
        "|---|---|---|---|---|---|",
    ]
    base = {r.database: r.makespan_s for r in results if r.label == f"1 runner, -j {jobs}"}
    for r in results:
        speedup = base[r.database] / r.makespan_s if r.makespan_s > 0 else float("nan")
        lines.append(
            f"| {r.database} | {r.label} | {r.makespan_s:.1f} s | {' + '.join(map(str, r.per_runner))} | "
            f"{'yes' if r.exactly_once else 'NO'} | {speedup:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=2, help="slots per runner (J)")
    parser.add_argument("--wait", type=float, default=1.0, help="slow_start_s of every cell")
    parser.add_argument("--postgres-url", default=os.environ.get("MATRIX_TEST_POSTGRES_URL"))
    parser.add_argument("--no-write", action="store_true", help="print, do not append to docs/benchmarks.md")
    args = parser.parse_args()
    kinds = ["sqlite"] + (["postgresql"] if args.postgres_url else [])
    configurations = [
        (f"1 runner, -j {args.jobs}", 1, args.jobs),
        (f"1 runner, -j {2 * args.jobs}", 1, 2 * args.jobs),
        (f"2 runners (owner + --join), -j {args.jobs} each", 2, args.jobs),
    ]
    results = []
    for kind in kinds:
        for label, runners, jobs in configurations:
            result = run_configuration(kind, args.postgres_url, label, runners, jobs, args.cells, args.wait)
            print(f"{kind:<10} {label:<40} {result.makespan_s:6.1f} s  {result.per_runner}", flush=True)
            results.append(result)
    section = report(results, args.cells, args.jobs, args.wait)
    print(section)
    if not args.no_write:
        append_section(section)
    if not all(r.exactly_once for r in results):
        raise SystemExit("a cell ran more than once or not at all")


if __name__ == "__main__":
    main()
