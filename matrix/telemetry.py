"""Peak resource use of one running cell: process RSS and CPU (psutil) and GPU memory (NVML).

A background thread samples every `interval_s` while the pair runs. Peaks are what the report needs
(two engines sharing one GPU must fit), so only maxima and totals are kept, not time series.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

from matrix.hardware.gpus import gpu_processes, memory_used

# The sampler may use at most about 1 / _DUTY of the time: a sample walks /proc, and on a small host a
# sampler running flat out (one sample took ~75 ms on a loaded 2-core host, the interval is 50 ms) takes
# CPU from the very engines whose start-up is being timed.
_DUTY = 5


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, from one pass over the process table (psutil's `children(recursive=True)`
    makes one such pass per call, i.e. per role and sample)."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info.get("ppid")
        if ppid is not None:
            children.setdefault(ppid, []).append(proc.pid)
    return children


def _tree(pid: int, children: Mapping[int, list[int]]) -> list[psutil.Process]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            found.append(psutil.Process(current))
        except psutil.Error:
            continue
        todo.extend(children.get(current, ()))
    return found


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
            started = time.monotonic()
            self.sample()
            if self._stop_event.wait(max(self._interval_s, _DUTY * (time.monotonic() - started))):
                break

    def sample(self) -> None:
        by_pid: dict[int, str] = {}
        children = _children_map()
        for role, pid in self._pids().items():
            rss, cpu = 0, 0.0
            for proc in _tree(pid, children):
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
