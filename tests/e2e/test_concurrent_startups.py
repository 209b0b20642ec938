"""[M17] goal 3: packed cells whose memory is bounded absolutely start up together; the others queue.

Real reference pairs (three processes each, workers slow to start so two start-ups would overlap) run
through the local executor on one GPU slot of a packed pool (a GPU as NVML would report it; the pairs run
on the CPU). What is asserted is the order the gate recorded, never a duration: with absolute bounds the
second start-up begins before the first is ready, otherwise it begins only after.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from matrix.cells import CaseInfo, Cell, RuntimeInfo
from matrix.executors.local import LocalExecutor
from matrix.hardware.gpus import GIB, Gpu
from matrix.hardware.ports import PortAllocator
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm
from matrix.markers import parse_marker_use
from matrix.outcome import CellOutcome
from matrix.paths import port_registry_path
from matrix.schedule import SlotPool, demand_for
from matrix.schedule.executor import Submission

REFERENCE = RuntimeInfo(
    backend="reference", version="0.1.0", tag="v0.1.0", provider={"kind": "builtin"},
    components={"matrix-reference": "0.1.0"},
)  # fmt: skip


def _case(name: str, kv_bound: dict[str, int], **launch: object) -> CaseInfo:
    return CaseInfo(
        name=name, backend="reference", arm="reference", model="reference-model",
        markers=(parse_marker_use("gpu_1"),), kv_bound=KvBound.parse(kv_bound), startup_timeout_s=60.0,
        launch={"faults": ["slow-start"], "slow_start_s": 1.5, **launch},
    )  # fmt: skip


def _run_two(tmp_path: Path, cases: list[CaseInfo]) -> list[CellOutcome]:
    gpu = Gpu(0, "GPU-fake", "Fake", 80 * GIB, 0)
    pool = SlotPool([gpu], pack=True, cpu_slots=0)
    allocator = PortAllocator(port_registry_path())
    executor = LocalExecutor(pool, allocator, max_workers=2, gpus=(gpu,))
    futures = []
    for index, case in enumerate(cases):
        cell = Cell(case=case, runtime=REFERENCE)
        arm = get_arm(case.arm)
        demand = demand_for(cell, cpu_ok=arm.runs_on_cpu(case), absolute_memory=arm.absolute_memory(case))
        lease = pool.try_acquire(demand)
        assert lease is not None and lease.gpu_indices == (0,)  # both packed on the one GPU
        submission = Submission(cell, f"cs{index}", 1, tmp_path / f"cell{index}", lease)
        futures.append(executor.submit(submission))
    try:
        return [future.result(timeout=120) for future in futures]
    finally:
        executor.shutdown()


def test_the_reference_arm_declares_both_kinds() -> None:
    arm = get_arm("reference")
    assert arm.absolute_memory(_case("a", {"bytes": 1 << 20}))
    assert not arm.absolute_memory(_case("b", {}))


@pytest.mark.parametrize(
    ("arm", "kv_bound", "launch", "absolute"),
    [
        ("vllm_native", {"bytes": 1 << 30}, {}, True),
        ("vllm_native", {"bytes": 1 << 30}, {"gpu_memory_utilization": 0.9}, False),  # sizes from free memory
        ("vllm_native", {"tokens": 2048}, {}, False),
        ("sglang_native", {"tokens": 2048}, {}, False),  # its start-up reads free memory (engines.py)
        ("sglang_native", {"tokens": 2048}, {"mem_fraction_static": 0.8}, False),
        ("dynamo", {"bytes": 1 << 30}, {"engine": "vllm"}, True),
        ("dynamo", {"tokens": 2048}, {"engine": "sglang"}, False),
        ("dynamo", {"bytes": 1 << 30}, {"engine": "vllm", "script": "launch/disagg.sh"}, False),
    ],
)
def test_engine_arms_vouch_only_for_absolute_bounds(
    arm: str, kv_bound: dict[str, int], launch: dict[str, object], absolute: bool
) -> None:
    bound = KvBound.parse(kv_bound)
    case = CaseInfo(name="c", backend="x", arm=arm, model="m", markers=(), kv_bound=bound, launch=launch)
    assert get_arm(arm).absolute_memory(case) is absolute


def test_bounded_cells_on_one_gpu_start_up_concurrently(tmp_path: Path) -> None:
    outcomes = _run_two(tmp_path, [_case(f"bounded{i}", {"bytes": 1 << 20}) for i in range(2)])
    assert [o.status for o in outcomes] == ["passed", "passed"], [o.message for o in outcomes]
    gpu = [o.gpu for o in outcomes]
    assert [g["startup_mode"] for g in gpu] == ["concurrent", "concurrent"]
    assert [g["startup_peers"] for g in gpu] == [1, 1]
    (a_in, a_ready), (b_in, b_ready) = (g["startup_window"] for g in gpu)
    assert max(a_in, b_in) < min(a_ready, b_ready)  # each began before the other was ready


def test_a_cell_that_sizes_from_free_memory_queues_its_startup(tmp_path: Path) -> None:
    cases = [_case("bounded", {"bytes": 1 << 20}), _case("measures", {"bytes": 1 << 20}, exclusive_startup=True)]
    outcomes = _run_two(tmp_path, cases)
    assert [o.status for o in outcomes] == ["passed", "passed"], [o.message for o in outcomes]
    gpu = [o.gpu for o in outcomes]
    assert [g["startup_mode"] for g in gpu] == ["concurrent", "exclusive"]
    assert [g["startup_peers"] for g in gpu] == [0, 0]
    first, second = sorted((g["startup_window"] for g in gpu), key=lambda w: w[0])
    assert first[1] <= second[0]  # one after the other


def test_a_queue_of_exclusive_startups_does_not_hold_back_the_concurrent_ones(tmp_path: Path) -> None:
    """[M31] The packed seed matrix's queue: three cells that must start alone, then three that may start
    together. The concurrent ones, already waiting when the first exclusive start-up ends, go in together
    before the next exclusive one; before the fix they waited behind every exclusive start-up."""
    gpu = Gpu(0, "GPU-fake", "Fake", 80 * GIB, 0)
    pool = SlotPool([gpu], pack=True, cpu_slots=0)
    executor = LocalExecutor(pool, PortAllocator(port_registry_path()), max_workers=6, gpus=(gpu,))
    exclusive = [_case(f"alone{i}", {"bytes": 1 << 20}, exclusive_startup=True, slow_start_s=2.0) for i in range(3)]
    together = [_case(f"together{i}", {"bytes": 1 << 20}, slow_start_s=2.0) for i in range(3)]
    futures = []
    try:
        for index, case in enumerate([*exclusive, *together]):
            cell = Cell(case=case, runtime=REFERENCE)
            arm = get_arm(case.arm)
            demand = demand_for(cell, cpu_ok=arm.runs_on_cpu(case), absolute_memory=arm.absolute_memory(case))
            lease = pool.try_acquire(demand)
            assert lease is not None and lease.gpu_indices == (0,)
            futures.append(executor.submit(Submission(cell, f"q{index}", 1, tmp_path / f"cell{index}", lease)))
            if index == 0:  # the first exclusive start-up is in progress before the others queue
                deadline = time.monotonic() + 60
                while not pool._startups[0]._exclusive and time.monotonic() < deadline:
                    time.sleep(0.01)
        outcomes = [future.result(timeout=180) for future in futures]
    finally:
        executor.shutdown()
    assert [o.status for o in outcomes] == ["passed"] * 6, [o.message for o in outcomes]
    records = sorted((o.gpu["startup_window"], o.gpu["startup_mode"], o.gpu["startup_peers"]) for o in outcomes)
    modes = [mode for _, mode, _ in records]
    assert modes[0] == "exclusive" and modes[1:4] == ["concurrent"] * 3, modes  # one exclusive turn, then all three
    assert [peers for _, mode, peers in records if mode == "concurrent"] == [2, 2, 2]  # they started together
    windows = [window for window, _, _ in records]
    for (window, mode, _), later in zip(records, windows[1:], strict=False):
        if mode == "exclusive":  # alone: the next start-up began only once it was ready
            assert window[1] <= later[0], records
