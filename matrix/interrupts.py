"""SIGINT/SIGTERM handling for the runner: a signal only sets a flag.

The driver loop checks the flag between short waits and then cancels every running pair itself, so a
signal never lands in the middle of a teardown or a database write. A second signal sets `forced`: the
driver then SIGKILLs the pairs still in their grace period instead of waiting it out.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class StopSignal:
    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self.count = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are only delivered to the main thread; callers elsewhere set `requested`
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def forced(self) -> bool:
        """A second signal came: stop waiting for pairs to exit, kill them."""
        return self.count > 1

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.requested = True
        self.count += 1
        self.signal_name = self.signal_name or signal.Signals(signum).name
