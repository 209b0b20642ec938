"""[M11] item 14: a runner killed with SIGKILL leaves nothing running: its cells' watchdogs kill the pairs.

The hanging pair never ends on its own (its start-up timeout is a minute away and its runner is dead), so
the wait below is only a limit: without a watchdog it runs out. How soon the pair goes is printed, not
asserted (a loaded host is no measure of the watchdog).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.helpers.catalogs import HANGING
from tests.helpers.cli import DATA, Matrix
from tests.helpers.processes import home_cell_processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# A limit for the wait, far below the pair's own start-up timeout (60 s), never a measure.
GONE_WITHIN_S = 30.0


def test_a_sigkilled_runner_leaves_no_process_behind(matrix: Matrix) -> None:
    extra = matrix.home / "hanging.toml"
    extra.write_text(HANGING)
    assert matrix("catalog", "sync", *map(str, sorted(DATA.glob("*.toml"))), str(extra)).exit_code == 0
    runner = matrix.popen("run", "--case", "hanging_pair", "--runtime", "reference=0.1.0", "-j", "2", "--no-report")
    try:
        deadline = time.monotonic() + 60
        while len(home_cell_processes(matrix.home)) < 3:  # frontend, prefill and decode, all hanging
            assert runner.poll() is None and time.monotonic() < deadline, "the pair never started"
            time.sleep(0.1)
        pair = home_cell_processes(matrix.home)
        watchdogs = [p for p in psutil.Process(runner.pid).children() if "watchdog.py" in " ".join(p.cmdline())]
        assert len(watchdogs) == 1, "one watchdog per running cell"
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
        killed_at = time.monotonic()
        while home_cell_processes(matrix.home) and time.monotonic() - killed_at < GONE_WITHIN_S:
            time.sleep(0.05)
        survivors = home_cell_processes(matrix.home)
        assert survivors == [], f"{len(survivors)} of {len(pair)} processes survived the runner"
        print(f"the pair was gone {time.monotonic() - killed_at:.2f} s after the runner's SIGKILL")
        psutil.wait_procs(watchdogs, timeout=2)  # the watchdog's job is done: it exits too
        assert not any(w.is_running() and w.status() != "zombie" for w in watchdogs)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for proc in home_cell_processes(matrix.home):
            proc.kill()
