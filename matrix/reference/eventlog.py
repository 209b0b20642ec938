"""One timestamped line per event on stderr, flushed at once so a supervisor sees it even if we die."""

from __future__ import annotations

import os
import sys
import time


class EventLog:
    """Writes `<UTC time> <role>[<pid>] <message>` lines to stderr."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._prefix = f"{role}[{os.getpid()}]"

    def __call__(self, message: str) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        try:
            sys.stderr.write(f"{stamp} {self._prefix} {message}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            # stderr closed or a broken pipe: logging must never take the server down.
            pass
