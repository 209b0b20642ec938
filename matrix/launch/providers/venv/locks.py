"""Cross-runner locks: one flock()ed file per environment, held while it is built or removed."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from matrix.launch.providers.buildprocs import BuildInterrupted, StopCheck, never

Echo = Callable[[str], None]


@contextmanager
def locked(
    path: Path, *, blocking: bool = True, on_wait: Callable[[], None] | None = None, stop: StopCheck = never
) -> Iterator[bool]:
    """Hold an exclusive flock on `path`; yields False (holding nothing) when not `blocking` and taken.

    flock() locks belong to the open file, so two runners, or two threads of one runner, exclude each
    other, and a runner that dies (even by SIGKILL) releases its lock with its last file descriptor.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                yield False
                return
            if on_wait is not None:
                on_wait()
            _wait_for_lock(fd, stop)
        yield True
    finally:
        os.close(fd)


def _wait_for_lock(fd: int, stop: StopCheck) -> None:
    """Take the flock once the other runner lets go, checking for a stop request meanwhile."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if stop():
                raise BuildInterrupted("stopped while waiting for another runner's build") from None
            time.sleep(0.2)
