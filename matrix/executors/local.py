"""Cells as threads of this process, on the slots of this host's `SlotPool`."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from matrix.check.baselines import OracleBaselines
from matrix.executors.grid_pair import run_pair
from matrix.executors.shared_engines import GridPlan, SharedEngines
from matrix.hardware.gpus import Gpu, memory_used
from matrix.hardware.ports import PortAllocator
from matrix.outcome import CellOutcome
from matrix.runner import LiveCells, Resources, run_cell
from matrix.schedule.executor import Submission
from matrix.schedule.slots import Lease, SlotPool, StartupGate

# After a GPU cell, how long to wait for NVML to show the GPU back near its baseline, and how near.
GPU_SETTLE_S = 30.0
GPU_SETTLE_TOLERANCE_BYTES = 256 * 2**20
_POLL_S = 0.1


class LocalExecutor:
    name = "local"

    def __init__(
        self,
        pool: SlotPool,
        allocator: PortAllocator,
        *,
        max_workers: int,
        gpus: tuple[Gpu, ...] = (),
        workspace: Path | None = None,
        grids: Mapping[str, GridPlan] | None = None,
    ) -> None:
        self._pool = pool
        self._allocator = allocator
        self._workspace = workspace
        self._gpus = {gpu.index: gpu for gpu in gpus}
        self._baseline = {gpu.index: gpu.memory_used for gpu in gpus}
        self._live = LiveCells()
        self._threads = ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix="cell")
        # Grids whose pairs share engines (`matrix.executors.shared_engines`), by grid name; each grid's
        # engines are made on its first pair and stopped by its last, or at shutdown.
        self._grids = dict(grids or {})
        self._shared: dict[str, SharedEngines] = {}
        # One store of the oracle's aggregated answers for the whole campaign: a skew grid's pairs with one
        # decode runtime, or two cases that differ only in what the pair does (the handshake check), compare
        # with one aggregated instance instead of starting one each.
        self._baselines = OracleBaselines()
        self._shared_lock = threading.Lock()

    def submit(self, submission: Submission) -> Future[CellOutcome]:
        return self._threads.submit(self._work, submission)

    def cancel_all(self) -> None:
        self._live.cancel_all()

    def stopping(self) -> list[tuple[str, float]]:
        return self._live.stopping()

    def kill_all(self) -> None:
        self._live.kill_all()

    @property
    def cancelled(self) -> bool:
        return self._live.cancelled

    def shutdown(self) -> None:
        self._threads.shutdown(wait=True)
        for engines in self._shared.values():
            engines.close()

    def _engines_for(self, submission: Submission) -> SharedEngines | None:
        grid = next((g for g in self._grids.values() if submission.cell.key in g.keys), None)
        if grid is None:
            return None
        with self._shared_lock:
            if grid.case not in self._shared:
                root = submission.log_dir.parent / f"shared-engines-{grid.case}"
                self._shared[grid.case] = SharedEngines(grid, root, self._allocator, self._live)
            return self._shared[grid.case]

    def _work(self, submission: Submission) -> CellOutcome:
        lease = submission.lease
        gate = self._pool.startup_gate(lease)
        resources = Resources(
            gpu_ids=lease.gpu_ids, host_gpus=len(self._gpus), startup_gate=gate, workspace=self._workspace,
            baselines=self._baselines,
        )
        engines = self._engines_for(submission)
        if engines is not None:
            outcome = run_pair(submission.cell, submission.uid, submission.log_dir, self._allocator, resources,
                               self._live, engines)  # fmt: skip
        else:
            outcome = run_cell(
                submission.cell, submission.uid, submission.log_dir, self._allocator, resources, self._live
            )
        if lease.gpu_indices:
            settle = self._settle(lease)
            # How the start-up went through its GPU's gate (mode, window, peers beside it), for the overlap.
            startup = gate.record() if isinstance(gate, StartupGate) else {}
            queue = {"startup_queue_s": round(outcome.queued_s, 3)}
            outcome = replace(outcome, gpu={**outcome.gpu, **settle, **queue, **startup})
        return outcome

    def _settle(self, lease: Lease) -> dict[str, object]:
        """Wait until the lease's GPUs are back near baseline; quarantine a GPU that does not clear."""
        info: dict[str, object] = {
            "indices": list(lease.gpu_indices),
            "uuids": [self._gpus[i].uuid for i in lease.gpu_indices if i in self._gpus],
            "names": [self._gpus[i].name for i in lease.gpu_indices if i in self._gpus],
        }
        after: dict[str, int | None] = {}
        for index in lease.gpu_indices:
            if any(index in other.gpu_indices for other in self._pool.active_leases if other != lease):
                continue  # still shared with a running cell: the last one out checks the baseline
            used = wait_for_baseline(index, self._baseline[index])
            if used is not None and used > self._baseline[index] + GPU_SETTLE_TOLERANCE_BYTES:
                baseline = self._baseline[index] / 2**30
                self._pool.quarantine(index, f"memory stayed at {used / 2**30:.2f} GiB, baseline {baseline:.2f} GiB")
            after[str(index)] = used
        info["memory_used_after"] = after
        info["baseline"] = {str(i): self._baseline.get(i) for i in lease.gpu_indices}
        return info


def wait_for_baseline(index: int, baseline: int, timeout_s: float = GPU_SETTLE_S) -> int | None:
    """NVML's used memory of GPU `index` once it is back near `baseline`, or the last reading at the
    deadline (None without NVML). Engines free device memory a moment after their process is reaped."""
    deadline = time.monotonic() + timeout_s
    used = memory_used(index)
    while used is not None and used > baseline + GPU_SETTLE_TOLERANCE_BYTES and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        used = memory_used(index)
    return used
