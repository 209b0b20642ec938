"""The makespan prediction replays the slot rules: packing, backfill and the start-up gate's turns."""

from __future__ import annotations

from dataclasses import replace

from matrix.hardware.gpus import GIB, Gpu
from matrix.schedule import Demand, SlotPool
from matrix.schedule.makespan import PlannedJob, predict_makespan


def _pool(*, pack: bool = True) -> SlotPool:
    return SlotPool([Gpu(0, "GPU-0", "Fake", 80 * GIB, 0)], pack=pack, cpu_slots=0)


def _job(key: str, startup_s: float, run_s: float, *, concurrent: bool) -> PlannedJob:
    demand = Demand(cell_key=key, gpus=1, memory_bytes=GIB, cpu_ok=False, concurrent_startup=concurrent)
    return PlannedJob(demand, startup_s, run_s)


def test_without_pack_cells_run_one_after_another() -> None:
    jobs = [_job(k, 10, 5, concurrent=True) for k in "abc"]
    assert predict_makespan(jobs, _pool(pack=False), workers=3) == 45


def test_bounded_startups_overlap_when_packed() -> None:
    jobs = [_job(k, 10, 5, concurrent=True) for k in "abc"]
    assert predict_makespan(jobs, _pool(), workers=3) == 15


def test_the_seed_queue_takes_one_exclusive_turn_before_the_concurrent_ones() -> None:
    """Six sidecar-like exclusive start-ups (longest first, so they queue first) and six native ones: the
    natives wait for one exclusive start-up, not for six."""
    exclusive = [_job(f"x{i}", 100, 10, concurrent=False) for i in range(6)]
    native = [_job(f"n{i}", 40, 300, concurrent=True) for i in range(6)]
    # x0 alone (0-100), the six natives together (100-140, done at 440), x1..x5 one by one (140-640), x5
    # runs to 650. With the old rule the natives started at 600 and ended at 940.
    assert predict_makespan([*exclusive, *native], _pool(), workers=12) == 650
    # If the sidecar start-ups were vouched for (no exclusive ones), all twelve start together.
    vouched = [replace(job, demand=replace(job.demand, concurrent_startup=True)) for job in exclusive]
    assert predict_makespan([*vouched, *native], _pool(), workers=12) == 340  # the natives, 40 + 300


def test_memory_limits_packing_and_smaller_jobs_backfill() -> None:
    big = replace(
        _job("big", 10, 10, concurrent=True), demand=Demand("big", 1, 60 * GIB, False, concurrent_startup=True)
    )
    small = [_job(k, 5, 5, concurrent=True) for k in "ab"]
    assert predict_makespan([big, *small], _pool(), workers=3) == 20  # all three fit in 78 GiB together
    huge = replace(big, demand=replace(big.demand, cell_key="huge", memory_bytes=70 * GIB))
    assert predict_makespan([huge, big], _pool(), workers=2) == 40  # one after the other
