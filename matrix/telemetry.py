"""Peak resource use of one running cell: process RSS and CPU (psutil) and GPU memory (NVML).

A background thread samples every `interval_s` while the pair runs. Peaks are what the report needs
(two engines sharing one GPU must fit), so only maxima and totals are kept, not time series.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

from matrix.hardware.gpus import gpu_processes, memory_used


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class PeakSampler(threading.Thread):
    def __init__(
        self, pids: Callable[[], Mapping[str, int]], gpu_indices: Sequence[int], interval_s: float = 0.2
    ) -> None:
        super().__init__(name="matrix-sampler", daemon=True)
        self._pids = pids
        self._gpus = tuple(gpu_indices)
        self._interval_s = interval_s
        self._stop_event = threading.Event()
        self.rss_peak: dict[str, int] = {}
        self.cpu_s: dict[str, float] = {}
        self.gpu_peak: dict[str, int] = {}
        self.device_peak: dict[int, int] = {}

    def run(self) -> None:
        while True:
            self.sample()
            if self._stop_event.wait(self._interval_s):
                break

    def sample(self) -> None:
        by_pid: dict[int, str] = {}
        for role, pid in self._pids().items():
            rss, cpu = 0, 0.0
            for proc in _tree(pid):
                try:
                    with proc.oneshot():
                        rss += proc.memory_info().rss
                        times = proc.cpu_times()
                        cpu += times.user + times.system
                    by_pid[proc.pid] = role
                except psutil.Error:
                    continue
            if rss:
                self.rss_peak[role] = max(self.rss_peak.get(role, 0), rss)
                self.cpu_s[role] = max(self.cpu_s.get(role, 0.0), cpu)
        for index in self._gpus:
            used = memory_used(index)
            if used is not None:
                self.device_peak[index] = max(self.device_peak.get(index, 0), used)
            per_role: dict[str, int] = {}
            for pid, used_bytes in gpu_processes(index).items():
                if pid in by_pid:
                    per_role[by_pid[pid]] = per_role.get(by_pid[pid], 0) + used_bytes
            for role, used_bytes in per_role.items():
                self.gpu_peak[role] = max(self.gpu_peak.get(role, 0), used_bytes)

    def stop(self) -> dict[str, Any]:
        self._stop_event.set()
        self.join(timeout=5)
        peaks: dict[str, Any] = {"rss_bytes": self.rss_peak, "cpu_s": {k: round(v, 3) for k, v in self.cpu_s.items()}}
        if self._gpus:
            peaks["gpu_bytes"] = self.gpu_peak
            peaks["device_used_bytes"] = {str(k): v for k, v in self.device_peak.items()}
        return peaks
