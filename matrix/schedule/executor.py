"""The interface the scheduler's driver uses to run claimed cells; `matrix.executors` implements it.

It lives beside its user so that `schedule` never imports `executors` (the executors import this).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from matrix.cells import Cell
from matrix.outcome import CellOutcome
from matrix.schedule.slots import Lease


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

    def stopping(self) -> list[tuple[str, float]]:
        """After `cancel_all`: (cell id, seconds left at most before it is killed) of each attempt still
        being torn down."""
        ...

    def kill_all(self) -> None:
        """Kill every running attempt's processes now (a second Ctrl-C), leaving nothing behind."""
        ...

    def shutdown(self) -> None:
        """Wait for submitted work to end and free what the executor holds."""
        ...
