"""Predict a campaign's makespan from expected durations and the slot rules, without running anything.

The leases come from a real `SlotPool` (same packing, same backfill as the scheduler: jobs longest first,
a later one taken when an earlier one does not fit); the start-up gate is replayed per GPU with the turns of
`slots._GpuStartups`: concurrent start-ups together, an exclusive one alone, concurrent ones that were
waiting when an exclusive one ended go in before the next exclusive one. Durations are the expected ones,
so the prediction is as good as they are; it ignores the runner's own overheads.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from matrix.schedule.slots import Demand, Lease, SlotPool


@dataclass(frozen=True)
class PlannedJob:
    """One cell to place: its demand, how long its engines take to start, and how long it runs once ready."""

    demand: Demand
    startup_s: float
    run_s: float

    @property
    def expected_s(self) -> float:
        return self.startup_s + self.run_s


@dataclass
class _Gate:
    shared: int = 0
    exclusive: bool = False
    epoch: int = 0
    waiting: list[tuple[int, bool, int]] = field(default_factory=list)  # (job index, shared, arrival epoch)


def _may_enter(gate: _Gate, shared: bool, arrived: int) -> bool:
    if shared:
        exclusive_waiting = any(not s for _, s, _ in gate.waiting)
        return not gate.exclusive and (not exclusive_waiting or gate.epoch > arrived)
    due = any(s and epoch < gate.epoch for _, s, epoch in gate.waiting)
    return not gate.exclusive and not gate.shared and not due


def predict_makespan(jobs: Sequence[PlannedJob], pool: SlotPool, *, workers: int) -> float:
    """Seconds from the first start to the last cell's end; `pool` must be fresh (it is used up)."""
    pending = sorted(range(len(jobs)), key=lambda i: -jobs[i].expected_s)
    gates: dict[int, _Gate] = {}
    leases: dict[int, Lease] = {}
    events: list[tuple[float, int, int, str]] = []  # (time, order, job, "ready" | "done")
    order = 0
    now = 0.0

    def gate_of(index: int) -> _Gate:
        return gates.setdefault(index, _Gate())

    def admit_at_gates() -> None:
        nonlocal order
        progress = True
        while progress:
            progress = False
            waiting = sorted({i for gate in gates.values() for i, _, _ in gate.waiting})
            for i in sorted(waiting, key=lambda i: not leases[i].concurrent_startup):  # shared first
                lease = leases[i]
                entries = [(gate_of(g), next(e for e in gate_of(g).waiting if e[0] == i)) for g in lease.gpu_indices]
                if all(_may_enter(gate, shared, arrived) for gate, (_, shared, arrived) in entries):
                    for gate, entry in entries:
                        gate.waiting.remove(entry)
                        gate.shared += entry[1]
                        gate.exclusive = gate.exclusive or not entry[1]
                    order += 1
                    heapq.heappush(events, (now + jobs[i].startup_s, order, i, "ready"))
                    progress = True

    while pending or events:
        left = []
        for i in pending:
            lease = pool.try_acquire(jobs[i].demand) if len(leases) < workers else None
            if lease is None:
                left.append(i)
                continue
            leases[i] = lease
            if lease.cpu:
                order += 1
                heapq.heappush(events, (now + jobs[i].startup_s, order, i, "ready"))
            for g in lease.gpu_indices:
                gate = gate_of(g)
                gate.waiting.append((i, lease.concurrent_startup, gate.epoch))
        pending = left
        admit_at_gates()
        if not events:
            if pending:
                raise ValueError(f"{len(pending)} job(s) can never start on this pool")
            break
        now, _, i, what = heapq.heappop(events)
        if what == "ready":
            for g in leases[i].gpu_indices:
                gate = gate_of(g)
                if leases[i].concurrent_startup:
                    gate.shared -= 1
                else:
                    gate.exclusive, gate.epoch = False, gate.epoch + 1
            order += 1
            heapq.heappush(events, (now + jobs[i].run_s, order, i, "done"))
        else:
            pool.release(leases.pop(i))
        admit_at_gates()
    return now


@dataclass(frozen=True)
class Forecast:
    """What `matrix plan --makespan` prints: the predicted makespan of the cells this host can run, with what
    it rests on."""

    makespan_s: float
    cells: int  # predicted (those the host can run)
    sum_s: float  # the cells one after another
    slowest_s: float  # the longest single cell
    from_history: int  # cells whose durations are medians of earlier attempts (the others: their timeouts)
    cannot_run: int  # cells this host can never run (a GPU cell on a CPU host...)
    workers: int


def forecast(jobs: Sequence[PlannedJob], pool: SlotPool, *, workers: int, from_history: int) -> Forecast:
    """Predict `jobs` on `pool` (used up); a job the pool can never fit is counted, not placed."""
    placeable = [job for job in jobs if pool.can_ever_fit(job.demand) is None]
    makespan = predict_makespan(placeable, pool, workers=workers) if placeable else 0.0
    return Forecast(
        makespan_s=makespan,
        cells=len(placeable),
        sum_s=sum(job.expected_s for job in placeable),
        slowest_s=max((job.expected_s for job in placeable), default=0.0),
        from_history=from_history,
        cannot_run=len(jobs) - len(placeable),
        workers=workers,
    )
