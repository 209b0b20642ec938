"""Benchmark: how long the CLI makes a user wait before and around the work.

Three commands, each a fresh process timed from spawn to exit, on the seed catalog in a new data directory:
`matrix --help`; `matrix plan --case reference_disaggregated`; and a one-cell `matrix run --backend
reference --case reference_disaggregated --no-report --quiet`, whose *added* time is the process's wall
time minus the cell's own `total_s` as recorded in the database.

Variants run round-robin so they share the host's load: this tree, and with `--baseline REF` the same
commands on that git revision (extracted with `git archive`). `python -X importtime` of each command on
this tree gives the modules that cost the most (cumulative), for the write-up.

The floor, in the same rounds: the interpreter alone; importing SQLAlchemy, plainly and with the GC handled
as `matrix` handles it; and importing the ORM with matrix's models (what any command reading the database
through the models pays before its first query), each a fresh process like the commands.

Run: python tests/bench/bench_cli_startup.py [--rounds 7] [--baseline REF] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

COMMANDS = {
    "matrix --help": ["--help"],
    "matrix plan --case reference_disaggregated": ["plan", "--case", "reference_disaggregated"],
    "one-cell matrix run": ["run", "--backend", "reference", "--case", "reference_disaggregated", "--no-report", "-q"],
}
# `GC` is what `matrix.cli.main` does around a command: the cyclic GC off while importing, the heap frozen
# before the interpreter exits.
GC_OFF, GC_FREEZE = "import gc; gc.disable(); ", "; gc.freeze()"
FLOOR = {
    "python -c pass": ["-c", "pass"],
    "python: import sqlalchemy": ["-c", "import sqlalchemy"],
    "python: import sqlalchemy, GC as matrix": ["-c", GC_OFF + "import sqlalchemy" + GC_FREEZE],
    "python: import sqlalchemy.orm, matrix.db.models, GC as matrix": [
        "-c", GC_OFF + "import matrix.db.models" + GC_FREEZE
    ],
}
IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|(\s+)(\S+)$")


def _tree(ref: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="matrix-baseline-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "matrix", "data", "migrations", "templates"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def _env(tree: Path, home: Path) -> dict[str, str]:
    # Bytecode is written and used, as after `pip install`: a shell with PYTHONDONTWRITEBYTECODE set would
    # otherwise compile every module on every start (over a second on a loaded 2-core host).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(tree), "MATRIX_HOME": str(home), "MATRIX_DB": str(home / "matrix.db")}


CPU: dict[tuple[str, str], list[float]] = {}


def _timed(args: list[str], env: dict[str, str], *, python: bool = False) -> float:
    """Wall seconds of one `matrix ARGS` process (`python ARGS` with `python`); its CPU seconds (user +
    system, children included) are kept in CPU, which a loaded host inflates far less than the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    # Run from the data directory: `python -m` puts the working directory first on sys.path, so from the
    # repository every variant would import this tree's matrix.
    argv = [sys.executable, *args] if python else [sys.executable, "-m", "matrix", *args]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=env["MATRIX_HOME"])
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-2000:]
        raise SystemExit(f"matrix {' '.join(args)} exited {result.returncode}: {output}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    CPU.setdefault((env["PYTHONPATH"], " ".join(args)), []).append(cpu)
    return elapsed


def _last_total_s(home: Path) -> float:
    with sqlite3.connect(home / "matrix.db") as db:
        (total,) = db.execute("SELECT total_s FROM cell_run ORDER BY id DESC LIMIT 1").fetchone()
    return float(total)


def _top_imports(args: list[str], env: dict[str, str], count: int = 6) -> list[tuple[str, float]]:
    """The top-level imports (and matrix's own modules) that cost the most, cumulative ms."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-m", "matrix", *args], env=env,
                         capture_output=True, text=True, cwd=env["MATRIX_HOME"]).stderr  # fmt: skip
    found: dict[str, float] = {}
    for line in err.splitlines():
        if (m := IMPORT_LINE.match(line)) and (len(m.group(3)) == 1 or m.group(4).startswith("matrix")):
            found[m.group(4)] = max(found.get(m.group(4), 0.0), int(m.group(2)) / 1000)
    return sorted(found.items(), key=lambda item: -item[1])[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", help="a git revision to measure as 'before', side by side")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    variants = {"this tree": REPO}
    if args.baseline:
        variants[f"at {args.baseline}"] = _tree(args.baseline)
    homes = {name: Path(tempfile.mkdtemp(prefix="matrix-bench-cli-")) for name in variants}
    for name, tree in variants.items():
        _timed(["catalog", "sync"], _env(tree, homes[name]))
        for command in COMMANDS.values():  # a warm-up: bytecode written, caches filled; not counted
            _timed(command, _env(tree, homes[name]))
    floor_env = _env(REPO, homes["this tree"])
    for command in FLOOR.values():
        _timed(command, floor_env, python=True)
    walls: dict[tuple[str, str], list[float]] = {}
    floor: dict[str, list[float]] = {label: [] for label in FLOOR}
    added: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            env = _env(variants[name], homes[name])
            for label, command in COMMANDS.items():
                wall = _timed(command, env)
                walls.setdefault((name, label), []).append(wall)
                if command[0] == "run":
                    added[name].append(wall - _last_total_s(homes[name]))
        for label, command in FLOOR.items():
            floor[label].append(_timed(command, floor_env, python=True))

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.0f}"

    names = list(variants)
    lines = [
        f"\n## CLI start-up ({dt.date.today()}, {os.cpu_count()} cores)\n",
        f"`python tests/bench/bench_cli_startup.py --rounds {args.rounds}"
        f"{' --baseline ' + args.baseline if args.baseline else ''}`: each command a fresh process, spawn to exit, "
        f"medians of {args.rounds} interleaved rounds after a warm-up (bytecode written, as after `pip install`); "
        "seed catalog in a new SQLite database.\n",
        "| command | " + " | ".join(f"{name}, ms" for name in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, command in COMMANDS.items():
        lines.append(f"| {label} (wall) | " + " | ".join(ms(walls[(name, label)]) for name in names) + " |")
        cpu = [ms(CPU[(str(variants[name]), " ".join(command))][1:]) for name in names]  # [0]: the warm-up
        lines.append(f"| {label} (CPU, children included) | " + " | ".join(cpu) + " |")
    added_ms = " | ".join(ms(added[name]) for name in names)
    lines.append(f"| one-cell matrix run: wall - the cell's `total_s` | {added_ms} |")
    lines += ["\nThe floor, in the same rounds (this interpreter, same environment):\n",
              "| process | wall, ms | CPU, ms |", "|---|---|---|"]  # fmt: skip
    for label, command in FLOOR.items():
        lines.append(f"| {label} | {ms(floor[label])} | {ms(CPU[(str(REPO), ' '.join(command))][1:])} |")
    lines.append("\n`python -X importtime` on this tree, largest cumulative imports (top level, and matrix's own):\n")
    env = _env(REPO, homes["this tree"])
    for label, command in COMMANDS.items():
        top = ", ".join(f"{module} {cost:.0f} ms" for module, cost in _top_imports(command, env))
        lines.append(f"- {label}: {top}")
    lines.append(f"\nLoad average over the last minute at the end: {os.getloadavg()[0]:.1f}.\n")
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        sys.path.insert(0, str(REPO))
        from tests.bench.results import append_section

        append_section(report)


if __name__ == "__main__":
    main()
