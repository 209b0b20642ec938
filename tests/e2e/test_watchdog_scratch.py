"""A cell's watchdog, started as the supervisor starts it: when the runner dies (the pipe's write end closes
without "done") it kills the cell's processes and then removes the plan's scratch directories, which the
runner's teardown would have removed; a dismissed watchdog (the teardown ran) leaves them alone.

Real processes and a real pipe: the "cell" is a sleeping interpreter carrying the cell's MATRIX_CELL_ID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from matrix.launch import watchdog
from matrix.launch.supervisor import _Watchdog

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

# A limit for the waits below, never a measure.
WITHIN_S = 20.0


def _start_cell(cell_id: str, scratch: Path) -> tuple[subprocess.Popen[bytes], _Watchdog]:
    """A sleeping process of the cell, writing into its scratch directory, and the cell's watchdog, started
    as the supervisor starts it."""
    (scratch / "nested").mkdir(parents=True)
    (scratch / "nested" / "file.json").write_text("{}")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                               env={**os.environ, watchdog.CELL_ENV: cell_id})  # fmt: skip
    watcher = _Watchdog.start(cell_id, os.environ, scratch=(str(scratch),))
    assert watcher is not None
    return sleeper, watcher


def test_a_dead_runner_s_cell_loses_its_processes_and_then_its_scratch(tmp_path: Path) -> None:
    scratch = tmp_path / "matrix-cell-tmp"
    sleeper, watcher = _start_cell(f"watchdog-test-{uuid.uuid4().hex[:8]}", scratch)
    try:
        os.close(watcher._write_fd)  # the runner is gone: its end of the pipe closes with it
        assert watcher._popen.wait(timeout=WITHIN_S) == 0
        assert sleeper.wait(timeout=WITHIN_S) == -9  # killed by the sweep, before the directory went
        assert not scratch.exists()
    finally:
        for proc in (sleeper, watcher._popen):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_dismissed_watchdog_leaves_processes_and_scratch_to_the_teardown(tmp_path: Path) -> None:
    scratch = tmp_path / "matrix-cell-tmp"
    sleeper, watcher = _start_cell(f"watchdog-test-{uuid.uuid4().hex[:8]}", scratch)
    try:
        watcher.dismiss()  # the teardown ran
        assert watcher._popen.wait(timeout=WITHIN_S) == 0
        assert psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE
        assert (scratch / "nested" / "file.json").is_file()
    finally:
        for proc in (sleeper, watcher._popen):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_arguments_round_trip() -> None:
    argv = watchdog.watchdog_argv(7, "cell-a", "docker", ("/x", "/y z"))
    assert argv == ["7", "cell-a", "--engine", "docker", "--remove", "/x", "--remove", "/y z"]
    assert watchdog.watchdog_argv(3, "cell-b") == ["3", "cell-b"]
