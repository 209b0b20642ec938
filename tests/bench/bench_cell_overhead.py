"""Benchmark: the runner's own overhead per reference cell.

overhead = total cell time - the servers' own time to ready - the request - the servers' own shutdown

The servers' own times come from the timestamps the reference processes write into their logs
("ready", "received SIGTERM", "stopped"); everything else (port allocation, planning the launch,
spawning, health polling latency, validation, the teardown sweep and port checks) is the runner's.
Run: python tests/bench/bench_cell_overhead.py [--cells 20]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

STAMP = re.compile(r"^\S+ (\d{4}-\d\d-\d\dT[\d:.]+)Z (\w+)\[\d+\] (\w+)")
SPAWN = re.compile(r"^(\S+) \[matrix\] starting ")


def _ts(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def server_times(log_dir: Path) -> tuple[float, float]:
    """(spawn -> last process ready, longest SIGTERM -> stopped) from the servers' own log lines."""
    first_spawn, last_ready, shutdown = float("inf"), 0.0, 0.0
    for log in log_dir.glob("*.log"):
        term = None
        for line in log.read_text().splitlines():
            if m := SPAWN.match(line):
                first_spawn = min(first_spawn, _ts(m.group(1)))
            elif m := STAMP.match(line):
                ts, event = _ts(m.group(1) + "+00:00"), m.group(3)
                if event == "ready":
                    last_ready = max(last_ready, ts)
                elif event == "received":
                    term = ts
                elif event == "stopped" and term is not None:
                    shutdown = max(shutdown, ts - term)
    return last_ready - first_spawn, shutdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cells", type=int, default=20)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="matrix-bench-"))
    os.environ["MATRIX_HOME"] = str(home)
    from matrix.catalog.load import default_catalog_files, load_catalog
    from matrix.catalog.sync import sync_catalog
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.hardware.ports import PortAllocator
    from matrix.paths import port_registry_path
    from matrix.plan import Selection, plan_from_db
    from matrix.runner import run_cell

    engine = create_db_engine(f"sqlite:///{home / 'bench.db'}")
    ensure_schema(engine)
    factory = session_factory(engine)
    with transaction(factory) as session:
        sync_catalog(session, load_catalog(default_catalog_files()))
        (cell,) = plan_from_db(session, Selection(cases=("reference_disaggregated",))).cells
    allocator = PortAllocator(port_registry_path())

    rows = []
    for i in range(args.cells):
        outcome = run_cell(cell, f"bench{i}", home / f"cell{i}", allocator)
        if outcome.status != "passed":
            raise SystemExit(f"cell {i} {outcome.status}: {outcome.message}")
        ready, shutdown = server_times(home / f"cell{i}")
        assert outcome.total_s is not None and outcome.request_s is not None and outcome.ready_s is not None
        overhead = outcome.total_s - ready - outcome.request_s - shutdown
        rows.append((outcome.total_s, ready, outcome.ready_s - ready, outcome.request_s, shutdown, overhead))

    med = [statistics.median(col) * 1000 for col in zip(*rows, strict=True)]
    p90 = sorted(r[5] for r in rows)[int(0.9 * (len(rows) - 1))] * 1000
    report = (
        f"\n## Runner overhead per reference cell ({dt.date.today()}, {args.cells} cells, {os.cpu_count()} cores)\n\n"
        "`python tests/bench/bench_cell_overhead.py --cells " + str(args.cells) + "`\n\n"
        "| median of | ms |\n|---|---|\n"
        f"| total cell time | {med[0]:.1f} |\n"
        f"| servers' own spawn → ready | {med[1]:.1f} |\n"
        f"| readiness detected after the servers were ready | {med[2]:.1f} |\n"
        f"| request (client-measured) | {med[3]:.1f} |\n"
        f"| servers' own shutdown (SIGTERM → stopped) | {med[4]:.1f} |\n"
        f"| **runner overhead** (total - ready - request - shutdown) | **{med[5]:.1f}** (p90 {p90:.1f}) |\n\n"
        f"Target: under 200 ms. {'Met' if med[5] < 200 else 'NOT met'}.\n"
    )
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
