"""The watchdog of one cell: kills the cell's processes within moments of its runner's death, even a SIGKILL.

The cell's processes run in sessions of their own, so nothing reaches them when the runner dies outright.
The supervisor starts this script next to them (in a session of its own, without `MATRIX_CELL_ID`, so no
sweep ever takes it for part of the cell) and keeps the only write end of a pipe whose read end the
watchdog holds. The kernel closes that write end however the runner dies, so the watchdog's read returns
at once: end-of-file without the word ``done`` means the runner is gone, and the watchdog SIGKILLs every
process carrying the cell's `MATRIX_CELL_ID`. A normal teardown writes ``done`` and the watchdog exits.

Why not the kernel's parent-death signal (PR_SET_PDEATHSIG): it fires when the *thread* that forked the
child exits, not the process (and runners start cells from worker threads), and it reaches only the direct
child, not an engine's own workers. The environment tag reaches them all.

Run as a script (`python -I watchdog.py FD CELL_ID`); it imports only the standard library and psutil,
so it starts fast and does not depend on how matrix itself was put on the path.
"""

from __future__ import annotations

import os
import signal
import sys
import time

CELL_ENV = "MATRIX_CELL_ID"
DONE = b"done"
_SWEEP_FOR_S = 1.0


def _read_until_eof(fd: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 64)
        except InterruptedError:
            continue
        if not chunk:
            return data
        data += chunk


def sweep(cell_id: str) -> int:
    """SIGKILL every process of the cell, again and again for a moment (a dying parent may still fork)."""
    import psutil

    killed: set[int] = set()
    deadline = time.monotonic() + _SWEEP_FOR_S
    while True:
        found = 0
        for proc in psutil.process_iter():
            if proc.pid == os.getpid():
                continue
            try:
                if proc.environ().get(CELL_ENV) != cell_id or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                proc.kill()
            except (psutil.Error, OSError):
                continue
            found += 1
            killed.add(proc.pid)
        if not found or time.monotonic() >= deadline:
            return len(killed)
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    fd, cell_id = int(argv[1]), argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the runner, which tears down itself
    if _read_until_eof(fd).strip() == DONE:
        return 0
    sweep(cell_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
