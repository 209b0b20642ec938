"""Where cells run: threads on this host (`local`) or tasks on a Ray cluster (`ray`).

An executor only runs cells and hands back their outcomes; the scheduler's driver thread decides what
starts when and alone writes the database. Both executors call the same `matrix.runner.run_cell`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from matrix.plan import Cell
from matrix.runner import CellOutcome
from matrix.schedule.slots import Lease

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Submission:
    """One attempt the driver has claimed and wants run."""

    cell: Cell
    uid: str
    attempt: int
    # Where the attempt's logs must end up on the driver's host (the row's log_dir).
    log_dir: Path
    lease: Lease


class CellExecutor(Protocol):
    name: str

    def submit(self, submission: Submission) -> Future[CellOutcome]:
        """Start the attempt; the future never raises for a cell's own failure, only for bugs."""
        ...

    def cancel_all(self) -> None:
        """Tear down every running attempt (idempotent); later submissions are torn down at once."""
        ...

    @property
    def cancelled(self) -> bool: ...

    def shutdown(self) -> None:
        """Wait for submitted work to end and free what the executor holds."""
        ...
