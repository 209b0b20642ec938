"""[M21] items 12 and 13: what a person sees while `matrix run` runs and when it is stopped.

* On a terminal (a real pseudo-terminal), a running cell's elapsed time ticks and the header never says
  `2 running ()`.
* Ctrl-C while pairs ignore SIGTERM: the runner says what it waits for with a countdown; a second Ctrl-C
  kills the pairs at once, and nothing of them is left; the summary lists the cells that never started
  and the `matrix run --resume N` command that finishes the campaign.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.cli import DATA, Matrix
from tests.helpers.processes import home_cell_processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SLOW = """
[[case]]
name = "slow_pair"
backend = "reference"
arm = "reference"
model = "matrix-reference-tiny"
markers = ["e2e", "gpu_0"]
startup_timeout_s = 30
launch = { faults = ["slow-start"], slow_start_s = 3 }
"""

# Never ready, and deaf to SIGTERM: a teardown waits out the whole grace period before SIGKILL.
STUBBORN = """
[[runtime]]
backend = "reference"
version = "0.2.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.2.0" }

[[case]]
name = "stubborn_pair"
backend = "reference"
arm = "reference"
model = "matrix-reference-tiny"
markers = ["e2e", "gpu_0"]
startup_timeout_s = 120
launch = { faults = ["hang-at-start", "ignore-sigterm"], teardown_grace_s = 40 }
"""
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def sync(m: Matrix, extra: str) -> None:
    path = m.home / "extra.toml"
    path.write_text(extra)
    assert m("catalog", "sync", *map(str, sorted(DATA.glob("*.toml"))), str(path)).exit_code == 0


def deaf(home: Path) -> bool:
    """Whether the pair's three processes have said they ignore SIGTERM (workers: and hang)."""
    logs = {p.stem: p.read_text(errors="replace") for p in home.glob("runs/campaign-*/*/*.log")}
    return ("ignoring SIGTERM" in logs.get("frontend", "") and "hanging before listening" in logs.get("prefill", "")
            and "hanging before listening" in logs.get("decode", ""))  # fmt: skip


def test_progress_on_a_terminal_ticks_and_has_no_empty_counts(matrix: Matrix) -> None:
    sync(matrix, SLOW)
    leader, follower = pty.openpty()
    env = {**matrix.env, "TERM": "xterm", "COLUMNS": "120", "LINES": "40"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "matrix", "run", "--case", "slow_pair", "--runtime", "reference=0.1.0",
         "--no-report"], env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # the terminal closed: the run is over
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=60)
    screen = ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))
    assert proc.returncode == 0, screen
    elapsed = [float(x) for x in re.findall(r"(\d+\.\d)s +slow_pair@", screen)]
    assert elapsed and max(elapsed) >= 1.0, f"the running cell's time never ticked: {elapsed}\n{screen}"
    assert "running ()" not in screen and "1 running" in screen, screen


def test_ctrl_c_says_what_it_waits_for_and_a_second_one_kills_at_once(matrix: Matrix) -> None:
    sync(matrix, STUBBORN)
    runner = matrix.popen("run", "--case", "stubborn_pair", "-j", "1", "--no-report")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(runner.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        # One pair (frontend, prefill, decode) that has set SIGTERM aside: a signal before that would end it.
        while not deaf(matrix.home):
            assert runner.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        runner.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        while not any("waiting for 1 pair(s) to exit after SIGTERM" in line for line in lines):
            assert runner.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        countdown = next(line for line in lines if "waiting for 1 pair(s)" in line)
        assert re.search(r"SIGKILL in \d+s at most", countdown) and "Ctrl-C again" in countdown, countdown
        assert home_cell_processes(matrix.home), "the pair ignores SIGTERM: it is still there during the grace"
        runner.send_signal(signal.SIGINT)
        # The grace period is 40 s a stage: without the second Ctrl-C the runner would still be waiting.
        runner.wait(timeout=20)
        reader.join(timeout=5)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        left = home_cell_processes(matrix.home)
        for proc in left:
            proc.kill()
    out = "".join(lines)
    assert left == [], f"{len(left)} process(es) left behind\n{out}"
    assert runner.returncode == 3, out
    assert "second SIGINT: killing 1 pair(s) now" in out
    assert re.search(r"not started \(1\): stubborn_pair@reference-0\.[12]\.0", out), out
    assert "matrix run --resume 1" in out
    statuses = sorted(s for (s,) in matrix.sql("SELECT status FROM cell_run"))
    assert statuses == ["interrupted", "pending"], statuses
