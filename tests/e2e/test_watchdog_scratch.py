"""A cell's watchdog, run as the supervisor runs it: when the runner dies (the pipe's write end closes
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

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

# A limit for the waits below, never a measure.
WITHIN_S = 20.0


def _start_cell(cell_id: str, scratch: Path) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], int]:
    """A sleeping process of the cell, writing into its scratch directory, and the cell's watchdog."""
    (scratch / "nested").mkdir(parents=True)
    (scratch / "nested" / "file.json").write_text("{}")
    env = {**os.environ, watchdog.CELL_ENV: cell_id}
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
    read_fd, write_fd = os.pipe()
    try:
        watcher = subprocess.Popen(
            [sys.executable, "-I", watchdog.__file__, *watchdog.watchdog_argv(read_fd, cell_id, "", (str(scratch),))],
            pass_fds=(read_fd,), env={k: v for k, v in os.environ.items() if k != watchdog.CELL_ENV},
            start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(read_fd)
    return sleeper, watcher, write_fd


def test_a_dead_runner_s_cell_loses_its_processes_and_then_its_scratch(tmp_path: Path) -> None:
    scratch = tmp_path / "matrix-cell-tmp"
    sleeper, watcher, write_fd = _start_cell(f"watchdog-test-{uuid.uuid4().hex[:8]}", scratch)
    try:
        os.close(write_fd)  # the runner is gone: its end of the pipe closes with it
        assert watcher.wait(timeout=WITHIN_S) == 0
        assert sleeper.wait(timeout=WITHIN_S) == -9  # killed by the sweep, before the directory went
        assert not scratch.exists()
    finally:
        for proc in (sleeper, watcher):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_dismissed_watchdog_leaves_processes_and_scratch_to_the_teardown(tmp_path: Path) -> None:
    scratch = tmp_path / "matrix-cell-tmp"
    sleeper, watcher, write_fd = _start_cell(f"watchdog-test-{uuid.uuid4().hex[:8]}", scratch)
    try:
        os.write(write_fd, watchdog.DONE)
        os.close(write_fd)
        assert watcher.wait(timeout=WITHIN_S) == 0
        assert psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE
        assert (scratch / "nested" / "file.json").is_file()
    finally:
        for proc in (sleeper, watcher):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_arguments_round_trip() -> None:
    argv = watchdog.watchdog_argv(7, "cell-a", "docker", ("/x", "/y z"))
    assert argv == ["7", "cell-a", "--engine", "docker", "--remove", "/x", "--remove", "/y z"]
    assert watchdog.watchdog_argv(3, "cell-b") == ["3", "cell-b"]
