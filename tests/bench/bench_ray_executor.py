"""Benchmark: one campaign through the local executor and through a Ray cluster of 2 worker processes.

The campaign is N real reference pairs (default 16) whose workers wait `slow_start_s` (default 1 s)
before listening, so two at a time keep both executors busy without saturating a small host. A Ray
head is started here with `--num-cpus 2 --num-gpus 0` (two task slots: two Ray worker processes), and
both executors run with `--jobs 2`, alternating, several rounds, each with a fresh MATRIX_HOME:

* makespan: campaign `finished_at - started_at` from the database;
* per-cell time: median `total_s` (the cell itself: start-up, request, teardown);
* overhead per cell: (2 x makespan - sum of total_s) / N: claims, writes, and for Ray the task
  submission, the object transfer of the outcome and its logs.

Also measured once: `--executor ray` without an address, which starts and stops its own cluster.
Run: python tests/bench/bench_ray_executor.py [--cells 16] [--rounds 3] (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

SEED_FILES = ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")
# Ray >= 2.5x would write a token to ~/.ray/auth_token for the private cluster; a benchmark leaves no trace.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def write_catalog(directory: Path, cells: int, slow_start_s: float) -> list[str]:
    lines = ['[[marker]]\nname = "bench_ray"\ndescription = "benchmark cells"\n']
    for i in range(cells):
        lines.append(
            f'[[case]]\nname = "bench_ray_{i:03d}"\nbackend = "reference"\narm = "reference"\nmodel = "tiny"\n'
            f'markers = ["bench_ray"]\nstartup_timeout_s = 60\nrequest_timeout_s = 20\n'
            f'launch = {{ faults = ["slow-start"], slow_start_s = {slow_start_s} }}\n'
        )
    path = directory / "bench.toml"
    path.write_text("\n".join(lines))
    return [str(path)] + [str(REPO / "data" / name) for name in SEED_FILES]


def matrix(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MATRIX_HOME": str(home), "MATRIX_DB": str(home / "matrix.db")}
    return subprocess.run([sys.executable, "-m", "matrix", *args], env=env, capture_output=True, text=True,
                          check=False, timeout=1800)  # fmt: skip


def _seconds(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


def measure(catalog: list[str], extra: tuple[str, ...]) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    try:
        assert matrix(home, "catalog", "sync", *catalog).returncode == 0
        wall = time.monotonic()
        result = matrix(home, "run", "-m", "bench_ray", "--jobs", "2", "--quiet", "--no-report", *extra)
        wall = time.monotonic() - wall
        if result.returncode != 0:
            raise SystemExit(f"run failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        with sqlite3.connect(home / "matrix.db") as db:
            started, finished = db.execute("SELECT started_at, finished_at FROM campaign").fetchone()
            totals = [float(t) for (t,) in db.execute("SELECT total_s FROM cell_run WHERE status = 'passed'")]
        makespan = _seconds(finished) - _seconds(started)
        return {
            "wall": wall,
            "makespan": makespan,
            "cell": statistics.median(totals),
            "overhead": (2 * makespan - sum(totals)) / len(totals),
        }
    finally:
        shutil.rmtree(home, ignore_errors=True)


def start_head() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Path(tempfile.mkdtemp(prefix="bench-ray-head-")) / "head.log"
    argv = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--port", str(port),
            "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--num-gpus", "0", "--include-dashboard",
            "false", "--disable-usage-stats", "--object-store-memory", str(100 * 2**20)]  # fmt: skip
    with log.open("w") as out:
        head = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text():
        if head.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"Ray head did not start:\n{log.read_text()}")
        time.sleep(0.5)
    return head, f"127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slow-start", type=float, default=1.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ray-catalog-"))
    catalog = write_catalog(work, args.cells, args.slow_start)
    head, address = start_head()
    results: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    try:
        measure(catalog, ("--executor", "ray", "--ray-address", address))  # warm the cluster's worker pool
        for round_ in range(args.rounds):
            for name, extra in (("local", ()), ("ray", ("--executor", "ray", "--ray-address", address))):
                results[name].append(measure(catalog, extra))
                print(f"round {round_ + 1} {name}: {results[name][-1]}", flush=True)
    finally:
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=90)
    own = measure(catalog, ("--executor", "ray"))
    print(f"ray, own cluster: {own}", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    ratio = med("ray", "makespan") / med("local", "makespan")
    rows = "\n".join(
        f"| {name} | {med(name, 'makespan'):.2f} s | {med(name, 'wall'):.2f} s | {med(name, 'cell'):.2f} s | "
        f"{med(name, 'overhead') * 1000:.0f} ms |"
        for name in ("local", "ray")
    )
    report = f"""
## Ray executor vs local executor ({dt.date.today()}, {os.cpu_count()} cores)

`python tests/bench/bench_ray_executor.py --cells {args.cells} --rounds {args.rounds}`: {args.cells} reference
pairs (workers wait {args.slow_start:g} s before listening), `--jobs 2` for both; Ray is a local head with
2 CPUs (2 worker processes) and no GPUs, started once and warmed; medians of {args.rounds} alternating rounds.

| executor | makespan | `matrix run` wall | cell `total_s` | overhead per cell |
|---|---|---|---|---|
{rows}

Ray / local makespan: **{ratio:.2f}x**. A run that starts its own local cluster (`--executor ray`
without an address) took {own['wall']:.1f} s of wall time for a {own['makespan']:.1f} s campaign: the
cluster's start and stop are paid once per run, so point long campaigns at a running cluster.
"""
    print(report)
    append_section(report)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
