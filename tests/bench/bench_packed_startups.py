"""Benchmark: N packed cells on one GPU, start-ups concurrent (absolute memory bounds) vs queued.

Each cell is a real reference pair whose workers take `--slow-start` seconds before they listen (standing
in for an engine's start-up: they sleep, so the CPU is not what is measured), run through the local
executor on one GPU slot of a packed pool. Variants: every case bounded absolutely (start-ups share the
gate), every case with `launch.exclusive_startup` (start-ups queue, as every GPU start-up did before), and
one cell alone. The start-up overlap comes from what each attempt recorded (`startup_window`,
`startup_peers`). On an NVIDIA host `tests/gpu/` runs real engines; this measures the scheduling alone.

Run: python tests/bench/bench_packed_startups.py [--cells 8] [--slow-start 3] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from matrix.cells import CaseInfo, Cell, RuntimeInfo  # noqa: E402
from matrix.executors.local import LocalExecutor  # noqa: E402
from matrix.hardware.gpus import GIB, Gpu  # noqa: E402
from matrix.hardware.ports import PortAllocator  # noqa: E402
from matrix.kv_bound import KvBound  # noqa: E402
from matrix.launch.arms import get_arm  # noqa: E402
from matrix.markers import parse_marker_use  # noqa: E402
from matrix.outcome import CellOutcome  # noqa: E402
from matrix.schedule import SlotPool, demand_for  # noqa: E402
from matrix.schedule.executor import Submission  # noqa: E402
from tests.bench.results import append_section  # noqa: E402

REFERENCE = RuntimeInfo(backend="reference", version="0.1.0", tag="v0.1.0", provider={"kind": "builtin"})


def _campaign(work: Path, cells: int, slow_start: float, exclusive: bool) -> tuple[float, list[CellOutcome]]:
    gpu = Gpu(0, "GPU-bench", "Bench", 80 * GIB, 0)
    pool = SlotPool([gpu], pack=True, cpu_slots=0)
    executor = LocalExecutor(pool, PortAllocator(work / "ports.json"), max_workers=cells, gpus=(gpu,))
    launch = {"faults": ["slow-start"], "slow_start_s": slow_start, "exclusive_startup": exclusive}
    started = time.monotonic()
    futures = []
    for index in range(cells):
        case = CaseInfo(name=f"packed{index}", backend="reference", arm="reference", model="reference-model",
                        markers=(parse_marker_use("gpu_1"),), kv_bound=KvBound(bytes=1 << 20),
                        startup_timeout_s=60 + cells * slow_start * 2, launch=launch)  # fmt: skip
        arm = get_arm("reference")
        demand = demand_for(Cell(case, REFERENCE), cpu_ok=False, absolute_memory=arm.absolute_memory(case))
        lease = pool.try_acquire(demand)
        assert lease is not None
        submission = Submission(Cell(case, REFERENCE), f"p{index}", 1, work / f"cell{index}", lease)
        futures.append(executor.submit(submission))
    outcomes = [future.result() for future in futures]
    makespan = time.monotonic() - started
    executor.shutdown()
    bad = [o.message for o in outcomes if o.status != "passed"]
    if bad:
        raise SystemExit(f"cells failed: {bad}")
    return makespan, outcomes


def _overlap(outcomes: list[CellOutcome]) -> tuple[float, int]:
    """Seconds during which at least two start-ups were in progress, and the most at once."""
    edges = sorted(
        [(o.gpu["startup_window"][0], 1) for o in outcomes] + [(o.gpu["startup_window"][1], -1) for o in outcomes]
    )
    inside, most, overlapped, last = 0, 0, 0.0, 0.0
    for at, step in edges:
        if inside >= 2:
            overlapped += at - last
        inside += step
        most = max(most, inside)
        last = at
    return overlapped, most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=8)
    parser.add_argument("--slow-start", type=float, default=3.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="matrix-bench-pack-"))
    os.environ["MATRIX_HOME"] = str(work / "home")

    one, _ = _campaign(work / "one", 1, args.slow_start, exclusive=False)
    rows = []
    for name, exclusive in (("bounded: start-ups concurrent", False), ("exclusive_startup: queued", True)):
        makespan, outcomes = _campaign(work / name.split(":")[0], args.cells, args.slow_start, exclusive)
        overlapped, most = _overlap(outcomes)
        queued = max(o.gpu["startup_queue_s"] for o in outcomes)
        rows.append(f"| {name} | {makespan:.2f} | {makespan / one:.2f} | {overlapped:.2f} | {most} | {queued:.2f} |")
    report = "\n".join([
        f"\n## {args.cells} packed cells on one GPU slot: concurrent vs queued start-ups ({dt.date.today()}, "
        f"{os.cpu_count()} cores)\n",
        f"`python tests/bench/bench_packed_startups.py --cells {args.cells} --slow-start {args.slow_start:g}`: real "
        f"reference pairs whose workers wait {args.slow_start:g} s before listening (an engine start-up that "
        f"sleeps), through the local executor on one packed GPU slot. One cell alone: {one:.2f} s.\n",
        "| variant | makespan, s | / one cell | seconds with >= 2 start-ups in progress | most at once | "
        "longest queue wait, s |",
        "|---|---|---|---|---|---|",
        *rows,
    ]) + "\n"  # fmt: skip
    print(report)
    if not args.no_write:
        append_section(report)


if __name__ == "__main__":
    main()
