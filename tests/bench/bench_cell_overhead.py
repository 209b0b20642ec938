"""Benchmark: a matrix cell against a minimal hand-written driver of the same engine, side by side.

The yardstick (`drive`) launches exactly the processes the arm plans (same argv, same environment, same
ports), polls every probe every 20 ms with no other sleeps, sends the same request, then SIGTERMs every
process group and waits for the exits. It does none of matrix's safety work (watchdog, sampler, sweep
by MATRIX_CELL_ID, port checks, log pumps with timestamps): the ratio matrix / driver is what that costs.

Variants run in separate processes, round-robin, so they share the host's load: the driver, this tree's
`run_cell`, and with `--baseline REF` the `run_cell` of that git revision (extracted with `git archive`),
so a change is measured before and after in one run.

Engines: `reference` (the built-in pair, always available) or `mocker` (Dynamo's mocker; needs an
interpreter with ai-dynamo installed, `--dynamo-python PY`, used as a `host` runtime).

Run: python tests/bench/bench_cell_overhead.py [--engine mocker --dynamo-python PY] [--rounds 4 --cells 3]
     [--baseline REF]   (appends to docs/benchmarks.md unless --no-write)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

CASES = {"reference": "reference_disaggregated", "mocker": "dynamo_mocker_disaggregated"}
POLL_S = 0.02


def _catalog(home: Path, engine: str, dynamo_python: str | None) -> list[Path]:
    """The seed catalog, plus (for the mocker) a dynamo runtime that is the given interpreter."""
    files = sorted((REPO / "data").glob("*.toml"))
    if engine == "mocker":
        extra = home / "bench-dynamo.toml"
        extra.write_text(
            '[[runtime]]\nbackend = "dynamo"\nversion = "9.9.9"\n'
            f"provider = {{ kind = \"host\", python = {json.dumps(dynamo_python)} }}\n"
        )
        files.append(extra)
    return files


def _setup(home: Path, engine: str, dynamo_python: str | None) -> Any:
    """Sync the catalog into a fresh database in `home` and return the one cell."""
    from matrix.catalog.load import load_catalog
    from matrix.catalog.queries import plan_from_db
    from matrix.catalog.sync import sync_catalog
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.plan import Selection

    db = create_db_engine(f"sqlite:///{home / 'bench.db'}")
    ensure_schema(db)
    with transaction(session_factory(db)) as session:
        sync_catalog(session, load_catalog(_catalog(home, engine, dynamo_python)))
        runtime = ("dynamo=9.9.9",) if engine == "mocker" else ()
        plan = plan_from_db(session, Selection(cases=(CASES[engine],), runtimes=runtime))
    (cell,) = plan.cells
    return cell


_exit_waits: list[float] | None = None


def _timed_exits() -> list[float]:
    """Seconds the supervisor waits in `_wait_exits` (SIGTERM sent, until every process's exit is noticed),
    one entry per stage: the engines' own shutdown inside matrix's teardown. The rest of the teardown is
    matrix's (group checks, sweep by cell id, port checks, log pumps, the watchdog). Installed once per
    process; an older tree without `_wait_exits` is not split."""
    global _exit_waits
    if _exit_waits is None:
        from matrix.launch import supervisor

        _exit_waits = []
        wait_exits = getattr(supervisor, "_wait_exits", None)
        if wait_exits is not None:
            spent = _exit_waits

            def timed(*args: Any, **kwargs: Any) -> None:
                started = time.monotonic()
                try:
                    wait_exits(*args, **kwargs)
                finally:
                    spent.append(time.monotonic() - started)

            supervisor._wait_exits = timed  # type: ignore[attr-defined]
    return _exit_waits


def _run_matrix(cell: Any, home: Path, index: int) -> dict[str, float]:
    from matrix.hardware.ports import PortAllocator
    from matrix.paths import port_registry_path
    from matrix.runner import run_cell

    waits = _timed_exits()
    waits.clear()
    outcome = run_cell(cell, f"m{os.getpid()}x{index}", home / f"cell{index}", PortAllocator(port_registry_path()))
    if outcome.status != "passed":
        raise SystemExit(f"matrix cell {outcome.status}: {outcome.message}")
    row = {"total": outcome.total_s, "ready": outcome.ready_s, "request": outcome.request_s,
           "teardown": outcome.teardown_s}  # fmt: skip
    if waits:
        row["exits"] = sum(waits)
    return row


def _probe_ok(client: Any, probe: Any) -> bool:
    try:
        response = client.get(probe.url, timeout=1.0)
    except Exception:
        return False
    if response.status_code != 200:
        return False
    if probe.require_models and not response.json().get("data"):
        return False
    endpoints = [str(e) for e in response.json().get("endpoints", [])] if probe.require_endpoints else []
    return all(any(e.endswith(wanted) for e in endpoints) for wanted in probe.require_endpoints)


def _drive(cell: Any, home: Path, index: int) -> dict[str, float]:
    """The yardstick: spawn, 20 ms polls, request, SIGTERM, wait. Nothing else."""
    import httpx

    from matrix.check.client import send_chat
    from matrix.hardware.ports import PortAllocator
    from matrix.launch.arms import get_arm
    from matrix.launch.arms.base import LaunchContext
    from matrix.launch.providers import prepare
    from matrix.model_files import resolve_model_dir
    from matrix.paths import port_registry_path

    case, arm, cell_id = cell.case, get_arm(cell.case.arm), f"d{os.getpid()}x{index}"
    environment = prepare(cell.runtime)
    allocator = PortAllocator(port_registry_path())
    ports = allocator.allocate(cell_id, arm.port_requests(case))
    work = home / f"drive{index}"
    work.mkdir(parents=True)
    model_dir = resolve_model_dir(case.launch.model_dir, case.source_dir, environment.python)
    ctx = LaunchContext(cell_id=cell_id, case=case, runtime=cell.runtime, ports=ports, work_dir=work,
                        python=environment.python, gpu_ids=(), env=environment.env, model_dir=model_dir)  # fmt: skip
    plan = arm.plan(ctx)
    for scratch in plan.scratch_dirs:
        Path(scratch).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    procs = []
    for spec in plan.processes:
        log = (work / f"{spec.role}.log").open("wb")
        procs.append(subprocess.Popen(spec.argv, cwd=spec.cwd or str(work), env={**os.environ, **spec.env},
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    probes = [probe for spec in plan.processes for probe in spec.health] + list(plan.ready_probes)
    with httpx.Client(trust_env=False) as client:
        while probes:
            if any(p.poll() is not None for p in procs):
                tails = {f.name: f.read_text()[-1500:] for f in work.glob("*.log")}
                raise SystemExit(f"driver: a process died before ready: {tails}")
            probes = [probe for probe in probes if not _probe_ok(client, probe)]
            if probes:
                time.sleep(POLL_S)
    ready = time.monotonic() - started
    response = send_chat(plan.request)
    if response.status_code != 200:
        raise SystemExit(f"driver: request failed: {response.error}")
    request = response.request_s
    down = time.monotonic()
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.wait()
    done = time.monotonic()
    allocator.release(cell_id)
    return {"total": done - started, "ready": ready, "request": request, "teardown": done - down}


def worker(args: argparse.Namespace) -> None:
    home = Path(tempfile.mkdtemp(prefix="matrix-bench-"))
    os.environ["MATRIX_HOME"] = str(home)
    cell = _setup(home, args.engine, args.dynamo_python)
    run = _drive if args.worker == "driver" else _run_matrix
    run(cell, home, 0)  # a warm-up cell: lazy imports and first-use costs are not the cell's
    rows = [run(cell, home, i) for i in range(1, args.cells + 1)]
    print(json.dumps(rows))


def _tree(ref: str) -> Path:
    """The repository at `ref`, extracted into a temporary directory (only matrix/, data/ and migrations/)."""
    out = Path(tempfile.mkdtemp(prefix="matrix-baseline-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "matrix", "data", "migrations"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=tuple(CASES), default="reference")
    parser.add_argument("--dynamo-python", help="an interpreter with ai-dynamo installed (for --engine mocker)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cells", type=int, default=3, help="cells per variant per round (after a warm-up)")
    parser.add_argument("--baseline", help="a git revision to measure as 'before', side by side")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", choices=("driver", "matrix"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine == "mocker" and not args.dynamo_python:
        parser.error("--engine mocker needs --dynamo-python PY (an interpreter with ai-dynamo installed)")
    if args.worker:
        return worker(args)

    variants: dict[str, tuple[str, Path]] = {"driver": ("driver", REPO), "matrix (this tree)": ("matrix", REPO)}
    if args.baseline:
        variants[f"matrix at {args.baseline}"] = ("matrix", _tree(args.baseline))
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    common = ["--engine", args.engine, "--cells", str(args.cells)]
    common += ["--dynamo-python", args.dynamo_python] if args.dynamo_python else []
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            kind, tree = variants[name]
            # The driver always comes from this tree (it imports only the arm and the request client).
            # Bytecode written and used, as after `pip install` (the reference servers are matrix modules).
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["PYTHONPATH"] = str(tree if kind == "matrix" else REPO)
            done = subprocess.run([sys.executable, __file__, "--worker", kind, *common], env=env,
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
            rows[name] += json.loads(done.stdout.strip().splitlines()[-1])

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name]) * 1000

    driver_total = med("driver", "total")
    n = args.rounds * args.cells
    lines = [
        f"\n## One cell vs a minimal driver, {args.engine} ({dt.date.today()}, {os.cpu_count()} cores)\n",
        f"`python tests/bench/bench_cell_overhead.py --engine {args.engine} --rounds {args.rounds} --cells "
        f"{args.cells}{' --baseline ' + args.baseline if args.baseline else ''}`: {n} cells per variant, medians, "
        "variants interleaved round by round in separate processes (a warm-up cell each, not counted).\n",
        "| variant | total ms | ready ms | request ms | teardown ms | of it: exits after SIGTERM ms | "
        "of it: the rest ms | total / driver |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in variants:
        exits: float | None
        rest: float | None
        if name == "driver":  # its teardown is SIGTERM and waiting for the exits, nothing else
            exits, rest = med(name, "teardown"), 0.0
        elif all("exits" in r for r in rows[name]):
            exits = med(name, "exits")
            rest = statistics.median(r["teardown"] - r["exits"] for r in rows[name]) * 1000
        else:  # a tree from before the split
            exits = rest = None
        lines.append(
            f"| {name} | {med(name, 'total'):.0f} | {med(name, 'ready'):.0f} | {med(name, 'request'):.0f} | "
            f"{med(name, 'teardown'):.0f} | {'-' if exits is None else f'{exits:.0f}'} | "
            f"{'-' if rest is None else f'{rest:.0f}'} | {med(name, 'total') / driver_total:.2f} |"
        )
    load = os.getloadavg()[0]
    lines.append(f"\nLoad average over the last minute at the end: {load:.1f}.\n")
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        sys.path.insert(0, str(REPO))
        from tests.bench.results import append_section

        append_section(report)


if __name__ == "__main__":
    main()
