"""[M17] the peak sampler walks each role's whole process tree from one pass over the process table."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from matrix.telemetry import PeakSampler

PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'x = bytearray(64 << 20); import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_roles_peak_counts_its_children() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        sampler = PeakSampler(lambda: {"engine": parent.pid}, [], interval_s=0.05)
        deadline = time.monotonic() + 30
        while sampler.rss_peak.get("engine", 0) < 64 << 20 and time.monotonic() < deadline:
            sampler.sample()  # the child's 64 MiB buffer is counted once it is allocated
            time.sleep(0.05)
        assert sampler.rss_peak["engine"] >= 64 << 20, (child, sampler.rss_peak)
        sampler.start()
        peaks = sampler.stop()
        assert peaks["rss_bytes"]["engine"] >= 64 << 20 and peaks["cpu_s"]["engine"] > 0
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
