"""What an attempt is given (`Resources`) and the registry of running pairs a driver can cancel (`LiveCells`)."""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from matrix.check.baselines import OracleBaselines
from matrix.launch.supervisor import Supervisor


@dataclass(frozen=True)
class Resources:
    """What the scheduler granted one attempt."""

    # CUDA_VISIBLE_DEVICES entries (NVML indices) and the same GPUs as NVML indices for telemetry.
    gpu_ids: tuple[str, ...] = ()
    host_gpus: int = 0
    # A checkout that case launch scripts resolve against (`matrix run --workspace`).
    workspace: Path | None = None
    # Held while the pair starts, so start-ups on one GPU never overlap.
    startup_gate: AbstractContextManager[object] = field(default_factory=nullcontext)
    # The campaign's store of the oracle's aggregated answers (`matrix.check.baselines`); None: every pair
    # that passes starts its own aggregated instance.
    baselines: OracleBaselines | None = None


class LiveCells:
    """The supervisors of running cells, so the driver can cancel them all from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Supervisor] = {}
        self.cancelled = False

    def add(self, cell_id: str, supervisor: Supervisor) -> None:
        with self._lock:
            self._running[cell_id] = supervisor
            cancelled = self.cancelled
        if cancelled:
            supervisor.teardown()

    def remove(self, cell_id: str) -> None:
        with self._lock:
            self._running.pop(cell_id, None)

    def cancel_all(self) -> None:
        """Start tearing down every running pair, each in a thread of its own (teardown is idempotent and
        thread-safe), and return: the driver stays free to say what it waits for and to take a second
        Ctrl-C, which `kill_all` answers."""
        with self._lock:
            self.cancelled = True
            supervisors = list(self._running.values())
            self.cancelled_at = time.monotonic()
        for supervisor in supervisors:
            threading.Thread(target=supervisor.teardown, name="matrix-cancel", daemon=True).start()

    def stopping(self) -> list[tuple[str, float]]:
        """(cell id, seconds of grace left at most) of each pair still being torn down after `cancel_all`."""
        with self._lock:
            running = list(self._running.items())
            since = time.monotonic() - getattr(self, "cancelled_at", time.monotonic())
        return [(cell_id, max(0.0, supervisor.teardown_budget_s - since)) for cell_id, supervisor in running]

    def kill_all(self) -> None:
        """SIGKILL every process of every running pair now (a second Ctrl-C); their teardowns then finish
        at once, still checking that nothing is left."""
        with self._lock:
            supervisors = list(self._running.values())
        for supervisor in supervisors:
            supervisor.kill_now()
