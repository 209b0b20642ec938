"""[M29] item 1: Ctrl-C on a terminal never hangs the runner.

`matrix run` runs on a real pseudo-terminal (its controlling terminal, so the live panel and its refresh
thread are on) with pairs that ignore SIGTERM, and gets Ctrl-C as a person types it: the byte 0x03 written
to the terminal, which the kernel turns into SIGINT for the foreground process group. The first Ctrl-C
starts the countdown, the second kills the pairs. The panel's lock and rich's lock used to be taken in
opposite orders by the runner's main thread (printing the countdown) and rich's refresh thread, and a
quarter to a half of such runs hung for good. Many runs in a row must each exit 3, with nothing left `running`.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import DATA, Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

RUNS = 8  # the issue saw 4 of 8 such runs hang; here about 1 in 4 did on a loaded host
# Two pairs deaf to SIGTERM and never ready: a teardown waits out its grace period unless killed.
STUBBORN = """
[[case]]
name = "stubborn_one"
backend = "reference"
arm = "reference"
model = "matrix-reference-tiny"
markers = ["e2e", "gpu_0"]
startup_timeout_s = 120
launch = { faults = ["hang-at-start", "ignore-sigterm"], teardown_grace_s = 40 }

[[case]]
name = "stubborn_two"
backend = "reference"
arm = "reference"
model = "matrix-reference-tiny"
markers = ["e2e", "gpu_0"]
startup_timeout_s = 120
launch = { faults = ["hang-at-start", "ignore-sigterm"], teardown_grace_s = 40 }
"""
CTRL_C = b"\x03"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """`matrix run` on a pseudo-terminal of its own, everything it prints collected."""

    def __init__(self, m: Matrix, *args: str) -> None:
        self._leader, follower = pty.openpty()
        env = {**m.env, "TERM": "xterm", "COLUMNS": "120", "LINES": "40"}
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "matrix", *args], env=env, stdin=follower, stdout=follower, stderr=follower,
            start_new_session=True, preexec_fn=_take_terminal,  # a session whose controlling terminal it is
        )  # fmt: skip
        os.close(follower)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # Drained all the time: a full terminal buffer would block the runner's writes (a different hang).
        while True:
            try:
                data = os.read(self._leader, 65536)
            except OSError:  # the terminal closed: the run is over
                return
            if not data:
                return
            self._chunks.append(data)

    @property
    def screen(self) -> str:
        """What it printed, as text: rich's colours and the panel's cursor moves taken out."""
        return ANSI.sub("", b"".join(self._chunks).decode("utf-8", "replace"))

    def ctrl_c(self) -> None:
        os.write(self._leader, CTRL_C)

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while text not in self.screen:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        if self.proc.poll() is None:  # hung: only SIGKILL ends it (its pairs' watchdogs then kill them)
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._reader.join(timeout=5)
        os.close(self._leader)


def _take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _deaf(home: Path, campaign: int) -> bool:
    """Whether both pairs of the campaign have said they ignore SIGTERM and hang (workers)."""
    logs = [p.read_text(errors="replace") for p in home.glob(f"runs/campaign-{campaign}/*/*.log")]
    return sum("ignoring SIGTERM" in log for log in logs) >= 6 and sum("hanging before" in log for log in logs) >= 4


def _sync(m: Matrix) -> None:
    path = m.home / "stubborn.toml"
    path.write_text(STUBBORN)
    synced = m("catalog", "sync", *map(str, sorted(DATA.glob("*.toml"))), str(path))
    assert synced.exit_code == 0, synced.output


def test_ctrl_c_on_a_terminal_exits_3_every_time(matrix: Matrix) -> None:
    _sync(matrix)
    outcomes: list[str] = []
    for campaign in range(1, RUNS + 1):
        term = Terminal(matrix, "run", "--case", "stubborn_one", "--case", "stubborn_two", "-j", "2", "--no-report")
        try:
            deadline = time.monotonic() + 60
            while not _deaf(matrix.home, campaign):
                assert term.proc.poll() is None and time.monotonic() < deadline, term.screen
                time.sleep(0.05)
            term.ctrl_c()
            assert term.wait_for("to exit after SIGTERM", 20), term.screen  # the countdown
            term.ctrl_c()
            try:
                code = term.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                outcomes.append(f"run {campaign}: hung after the second Ctrl-C")
                continue
            if code != 3:
                outcomes.append(f"run {campaign}: exit {code}\n{term.screen[-2000:]}")
        finally:
            term.close()
    assert not outcomes, "\n".join(outcomes)
    assert matrix.sql("SELECT DISTINCT status FROM campaign") == [("interrupted",)]
    assert matrix.sql("SELECT count(*) FROM cell_run WHERE status = 'running'") == [(0,)]
    assert matrix.sql("SELECT count(*) FROM cell_run WHERE status = 'interrupted'") == [(2 * RUNS,)]
    left = [p for p in psutil.process_iter(["environ"]) if (p.info.get("environ") or {}).get("MATRIX_HOME")
            == str(matrix.home) and (p.info.get("environ") or {}).get("MATRIX_CELL_ID")]  # fmt: skip
    assert left == [], left
