"""Benchmark: planner and scheduler set-up overhead for 10,000 cells.

A synthetic catalog of 100 cases x 100 runtimes of one backend (10,000 combinations) with realistic
markers (lifecycle, hardware, framework, parametrised KV markers), version constraints and required
fixes is planned four ways:

* `make_plan` (pure, no database) with no selection: every combination becomes a cell (10,000), each
  checked against its constraint and its required fixes;
* `make_plan` with a CI-style selection: a marker expression, a --since bound and strict markers;
* `plan_from_db`: the same selection read back from a SQLite database the catalog was synced into
  (loading and detaching the rows included);
* the scheduler's pure set-up for the 10,000 cells: `demand_for` for each, the longest-expected-first
  sort, and a `SlotPool` (8 fake 80 GiB GPUs, --pack, 2 CPU slots) try_acquire/release loop that hands
  out every lease, plus one backfill scan of 10,000 pending demands over a full pool (what one pass
  of the driver loop costs when nothing fits).

Nothing is run: no processes, no NVML. Times are medians of --repeat runs (3 for the database path).
Run: python tests/bench/bench_plan_scale.py [--cases 100] [--runtimes 100]   (appends to docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from matrix.kv_bound import KvBound  # noqa: E402
from tests.bench.results import append_section  # noqa: E402

BACKEND = "vllm"
EXPRESSION = "(pre_merge or nightly) and gpu_1 and not h100"
SINCE = "vllm=0.24.0"
TARGET_S = 1.0
GIB = 2**30

# (name, kind, parametrised)
MARKERS = [
    ("pre_merge", "lifecycle", False),
    ("post_merge", "lifecycle", False),
    ("nightly", "lifecycle", False),
    ("weekly", "lifecycle", False),
    ("gpu_0", "hardware", False),
    ("gpu_1", "hardware", False),
    ("gpu_2", "hardware", False),
    ("h100", "hardware", False),
    ("vllm", "framework", False),
    ("e2e", "kind", False),
    ("integration", "kind", False),
    ("sidecar", "other", False),
    ("slow", "other", False),
    ("requested_vllm_kv_cache_bytes", "resource", True),
    ("profiled_vram_gib", "resource", True),
]
# (key, component, fixed_in): first fixed version on each release line.
FIXES = [
    ("vllm#54814", "vllm-rs", ["0.29.1rc0"]),
    ("vllm#51000", "vllm", ["0.26.2", "0.27.1"]),
    ("vllm-rs-kv-meta", "vllm-rs", ["0.25.0"]),
]


def runtime_versions(n: int) -> list[str]:
    """n distinct PEP 440 versions: releases with some release candidates and dev builds among them."""
    versions = []
    for i in range(n):
        minor, patch = 20 + i // 10, i % 10
        if i % 11 == 5:
            versions.append(f"0.{minor}.{patch}rc1")
        elif i % 13 == 7:
            versions.append(f"0.{minor}.{patch}rc1.dev{100 + i}+g{i:07x}")
        else:
            versions.append(f"0.{minor}.{patch}")
    return versions


def synthetic_catalog(n_cases: int, n_runtimes: int, seed: int) -> Any:
    """A `CatalogSpec` with one backend, `n_runtimes` runtimes and `n_cases` cases."""
    from matrix.catalog.spec import BackendSpec, CaseSpec, CatalogSpec, FixSpec, MarkerSpec, RuntimeSpec
    from matrix.versions import parse_version, tag_for

    rng = random.Random(seed)
    runtimes = []
    for version in runtime_versions(n_runtimes):
        v = parse_version(version)
        channel = "dev" if v.is_devrelease else "rc" if v.is_prerelease else "release"
        # Some runtimes ship a development vllm-rs next to an older Python vLLM, as real ones do.
        rs = version if rng.random() < 0.8 else f"{v.major}.{v.minor}.{v.micro}.dev3"
        runtimes.append(
            RuntimeSpec(
                backend=BACKEND, version=version, tag=tag_for(v), channel=channel, provider={"kind": "host"},
                components={"vllm": f"{v.major}.{v.minor}.{v.micro}", "vllm-rs": rs},
            )
        )  # fmt: skip
    cases = []
    for i in range(n_cases):
        lifecycle = rng.choice(["pre_merge", "post_merge", "nightly", "weekly"])
        gpu = rng.choices(["gpu_0", "gpu_1", "gpu_2"], weights=[2, 6, 2])[0]
        kv = rng.choice([268435456, 536870912, 1119388000, 2147483648])
        markers = [lifecycle, gpu, "vllm", rng.choice(["e2e", "integration"]), f"requested_vllm_kv_cache_bytes({kv})"]
        if rng.random() < 0.3:
            markers.append("sidecar")
        if rng.random() < 0.2:
            markers.append("h100")
        if rng.random() < 0.15:
            markers.append(f"profiled_vram_gib({rng.choice([8, 16, 40])})")
        if rng.random() < 0.1:
            markers.append("slow")
        # Constraints are evaluated for every combination; these admit every runtime here, so the
        # unselected plan keeps all combinations as cells.
        constraint = rng.choice(["", "", ">=0.20.0", ">=0.19.0,<1", "!=0.18.3", "<2"])
        fixes = rng.sample([f[0] for f in FIXES], k=rng.choice([0, 0, 1, 1, 2]))
        cases.append(
            CaseSpec(
                name=f"case_{i:03d}", backend=BACKEND, arm="dynamo", model="Qwen/Qwen3-0.6B", markers=markers,
                kv_bound=KvBound(bytes=kv), startup_timeout_s=float(rng.choice([120, 300, 600])),
                launch={"engine": "vllm", "max_model_len": 2048}, version_constraint=constraint,
                requires_fixes=fixes, weights_gib=rng.choice([1.5, 3.0, 7.5]),
            )
        )  # fmt: skip
    return CatalogSpec(
        backends=[BackendSpec(BACKEND)],
        runtimes=runtimes,
        markers=[MarkerSpec(name, kind, parametrised=p) for name, kind, p in MARKERS],
        fixes=[FixSpec(key, component, fixed_in) for key, component, fixed_in in FIXES],
        cases=cases,
        kinds={"backend", "runtime", "marker", "fix", "case"},
    )


def infos(spec: Any) -> tuple[list[Any], list[Any]]:
    """The catalog as the pure planner sees it (what `load_catalog_view` builds from rows)."""
    from matrix.cells import CaseInfo, RequiredFix, RuntimeInfo
    from matrix.markers import parse_marker_use

    fixes = {f.key: f for f in spec.fixes}
    cases = [
        CaseInfo(
            name=c.name, backend=c.backend, arm=c.arm, model=c.model,
            markers=tuple(parse_marker_use(text) for text in c.markers), marker_texts=tuple(c.markers),
            kv_bound=c.kv_bound, startup_timeout_s=c.startup_timeout_s,
            request_timeout_s=c.request_timeout_s,
            launch=dict(c.launch), version_constraint=c.version_constraint,
            required_fixes=tuple(
                RequiredFix(k, fixes[k].component, tuple(fixes[k].fixed_in)) for k in c.requires_fixes
            ),
            weights_gib=c.weights_gib, id=i,
        )
        for i, c in enumerate(spec.cases, start=1)
    ]  # fmt: skip
    runtimes = [
        RuntimeInfo(backend=r.backend, version=r.version, tag=r.tag, channel=r.channel, provider=dict(r.provider),
                    components=dict(r.components), id=i)
        for i, r in enumerate(spec.runtimes, start=1)
    ]  # fmt: skip
    return cases, runtimes


def median_time(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """(median seconds of `repeat` calls, the last result)."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def fake_gpus(n: int) -> tuple[Any, ...]:
    from matrix.hardware.gpus import Gpu

    return tuple(
        Gpu(index=i, uuid=f"GPU-{i:08x}-bench", name="NVIDIA H100 80GB HBM3", memory_total=80 * GIB,
            memory_used=GIB // 2)
        for i in range(n)
    )  # fmt: skip


def scheduler_setup(cells: tuple[Any, ...]) -> dict[str, int]:
    """What `run_campaign` and `Scheduler.run` do before and around launching: demands, sort, leases."""
    from matrix.launch.arms import get_arm
    from matrix.schedule.scheduler import Job
    from matrix.schedule.slots import SlotPool, demand_for

    jobs = []
    for cell in cells:
        cpu_ok = get_arm(cell.case.arm).runs_on_cpu(cell.case)
        expected = cell.case.startup_timeout_s + cell.case.request_timeout_s
        jobs.append(Job(cell, 1, expected, demand_for(cell, cpu_ok=cpu_ok)))
    pending = sorted(jobs, key=lambda job: -job.expected_s)
    pool = SlotPool(fake_gpus(8), pack=True, cpu_slots=2)
    active: deque[Any] = deque()
    granted = never = 0
    for job in pending:
        if pool.can_ever_fit(job.demand) is not None:
            never += 1
            continue
        lease = pool.try_acquire(job.demand)
        while lease is None:  # the oldest running cell finishes, then try again
            pool.release(active.popleft())
            lease = pool.try_acquire(job.demand)
        active.append(lease)
        granted += 1
    while active:
        pool.release(active.popleft())
    return {"granted": granted, "never": never}


def backfill_scan(cells: tuple[Any, ...]) -> int:
    """One pass of the driver's start loop over every pending demand while the pool is full."""
    from matrix.schedule.slots import Demand, SlotPool, demand_for

    pool = SlotPool(fake_gpus(8), pack=True, cpu_slots=2)
    for i in range(8):
        assert pool.try_acquire(Demand(f"hog{i}", 1, 0, cpu_ok=False, exclusive=True)) is not None
    for i in range(2):
        assert pool.try_acquire(Demand(f"cpu{i}", 0, 0, cpu_ok=True)) is not None
    demands = [demand_for(cell, cpu_ok=False) for cell in cells]
    start = time.perf_counter()
    refused = sum(1 for d in demands if pool.try_acquire(d) is None)
    elapsed = time.perf_counter() - start
    assert refused == len(demands)
    return int(elapsed * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--runtimes", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5, help="runs per pure measurement (the database path: 3)")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="matrix-bench-"))
    os.environ["MATRIX_HOME"] = str(home)
    from matrix.catalog.queries import plan_from_db
    from matrix.catalog.sync import sync_catalog
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.db.migrate import ensure_schema
    from matrix.plan import Selection, make_plan

    spec = synthetic_catalog(args.cases, args.runtimes, args.seed)
    combos = args.cases * args.runtimes
    markers = {name for name, _, _ in MARKERS}

    start = time.perf_counter()
    cases, runtimes = infos(spec)
    build_s = time.perf_counter() - start

    everything = Selection()
    ci = Selection(marker_expression=EXPRESSION, since=(SINCE,))

    def plan(selection: Selection) -> Any:
        return make_plan(cases, runtimes, selection, known_markers=markers, known_backends={BACKEND})

    all_s, all_plan = median_time(lambda: plan(everything), args.repeat)
    ci_s, ci_plan = median_time(lambda: plan(ci), args.repeat)
    assert len(all_plan.cells) == combos, "the unselected plan must keep every combination"
    annotated = sum(1 for c in all_plan.cells if c.missing_fixes)

    engine = create_db_engine(f"sqlite:///{home / 'bench.db'}")
    ensure_schema(engine)
    factory = session_factory(engine)
    start = time.perf_counter()
    with transaction(factory) as session:
        sync_catalog(session, spec)
    sync_s = time.perf_counter() - start

    def from_db(selection: Selection) -> Any:
        with transaction(factory) as session:
            return plan_from_db(session, selection)

    db_all_s, db_all = median_time(lambda: from_db(everything), 3)
    db_ci_s, db_ci = median_time(lambda: from_db(ci), 3)
    assert len(db_all.cells) == len(all_plan.cells) and len(db_ci.cells) == len(ci_plan.cells)

    sched_s, sched = median_time(lambda: scheduler_setup(all_plan.cells), args.repeat)
    scans = [backfill_scan(all_plan.cells) for _ in range(args.repeat)]
    scan_ms = statistics.median(scans) / 1000

    engine.dispose()
    shutil.rmtree(home, ignore_errors=True)

    n_all, n_ci = len(all_plan.cells), len(ci_plan.cells)
    worst = max(all_s, db_all_s)
    rows = f"({args.cases} + {args.runtimes} rows)"
    report = (
        f"\n## Planner and scheduler set-up at 10,000 cells ({dt.date.today()}, {os.cpu_count()} cores)\n\n"
        f"`python tests/bench/bench_plan_scale.py --cases {args.cases} --runtimes {args.runtimes}`\n\n"
        f"{args.cases} cases x {args.runtimes} runtimes of one backend = {combos:,} combinations; 4-6 markers "
        f"per case (two parametrised), version constraints, 0-2 required fixes per case. Medians of "
        f"{args.repeat} runs (database path: 3), `time.perf_counter`.\n\n"
        "| what | cells | ms |\n|---|---|---|\n"
        f"| build `CaseInfo`/`RuntimeInfo` (parse every marker), once | {rows} | {build_s * 1000:.1f} |\n"
        f"| `make_plan`, no selection (every combination checked, {annotated:,} annotated with missing fixes) "
        f"| {n_all:,} | {all_s * 1000:.1f} |\n"
        f'| `make_plan`, `-m "{EXPRESSION}" --since {SINCE}` | {n_ci:,} (+{len(ci_plan.excluded):,} excluded '
        f"with reasons) | {ci_s * 1000:.1f} |\n"
        f"| `sync_catalog` into a new SQLite database, once | {rows} | {sync_s * 1000:.1f} |\n"
        f"| `plan_from_db`, no selection (load rows + plan) | {n_all:,} | {db_all_s * 1000:.1f} |\n"
        f"| `plan_from_db`, the CI selection above | {n_ci:,} | {db_ci_s * 1000:.1f} |\n"
        f"| scheduler set-up: `demand_for` x {n_all:,}, longest-first sort, `SlotPool` (8 GPUs, pack, 2 CPU "
        f"slots) acquire/release of every lease ({sched['granted']:,} granted, {sched['never']} never fit) "
        f"| {n_all:,} | {sched_s * 1000:.1f} |\n"
        f"| one backfill scan: `try_acquire` refused for {n_all:,} pending demands on a full pool "
        f"| {n_all:,} | {scan_ms:.1f} |\n\n"
        f"Target: planning 10,000 cells under {TARGET_S * 1000:.0f} ms (pure and from the database). "
        f"{'Met' if worst < TARGET_S else 'NOT met'} (slowest: {worst * 1000:.0f} ms).\n"
    )
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
