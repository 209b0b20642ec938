"""SIGINT/SIGTERM handling that never interrupts a teardown.

While the runner is inside `interruptible()` a stop signal raises `CellInterrupted` at once (waking it
from a health poll or a request); anywhere else it only sets `requested`, which the runner checks
between steps. So a signal that lands during teardown lets the teardown finish.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class CellInterrupted(BaseException):
    """The runner was told to stop. A BaseException so no `except Exception` on the way swallows it."""


class StopSignal:
    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._armed = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are only delivered to the main thread; callers elsewhere poll `requested`
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        first = not self.requested
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if first and self._armed:
            self._armed = False
            raise CellInterrupted(self.signal_name)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        if self.requested:
            raise CellInterrupted(self.signal_name)
        self._armed = True
        try:
            yield
        finally:
            self._armed = False
