"""Who waited on what when a request got no answer: the evidence a `hang` outcome carries.

A pair that stops answering looks the same from the client whatever stalled: the decode engine waiting for KV
that never comes, the prefill stuck in its handshake, the proxy waiting on a dead upstream. Before matrix cuts
such a pair it reads, for every process of every role (the role's process and its descendants, e.g. vLLM's
engine core): its /proc state, the kernel function it sleeps in (`wchan`), how many of its threads sleep where,
and the last lines of the role's log; with the request that was in flight, that goes into the attempt's reason.

Linux-only reads of /proc; on another system (or for a process that is gone) the entries say so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import psutil

from matrix.check.specs import RequestSpec
from matrix.text import excerpt

# Per role: at most this many processes and log lines, so the reason stays readable in `matrix show`.
MAX_PROCESSES = 6
LOG_LINES = 4
# How much of one log line a hang report keeps.
LINE_CHARS = 300
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "traced",
           "Z": "zombie", "X": "dead", "I": "idle"}  # fmt: skip


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def _state(pid: int) -> str:
    """`S (sleeping)`: the state letter from /proc/PID/stat (after the command name, which may hold spaces)."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    letter = stat.rpartition(")")[2].split()[0] if ")" in stat else "?"
    return f"{letter} ({_STATES.get(letter, 'unknown')})"


def _wchan(path: Path) -> str:
    # "0" (or empty) means the task is not blocked in the kernel: it runs, or it spins in user space.
    value = _read(path)
    return value if value and value != "0" else "-"


def _threads(pid: int) -> str:
    """`12 threads: 9 in futex_wait_queue, 2 in do_epoll_wait, 1 running`: where the process's threads wait."""
    where: Counter[str] = Counter()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return ""
    for task in tasks:
        letter = _read(task / "stat").rpartition(")")[2].split()[:1]
        wchan = _wchan(task / "wchan")
        where["running" if letter == ["R"] else f"in {wchan}"] += 1
    parts = ", ".join(f"{n} {what}" for what, n in where.most_common(4))
    return f"{len(tasks)} threads: {parts}"


def _process_line(proc: psutil.Process) -> str:
    try:
        name = proc.name()
        pid = proc.pid
    except psutil.Error:
        return f"pid {proc.pid}: gone"
    return f"pid {pid} {name}: state {_state(pid)}, wchan {_wchan(Path(f'/proc/{pid}/wchan'))}; {_threads(pid)}"


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _log_tail(path: Path, lines: int = LOG_LINES) -> list[str]:
    """The last non-blank lines of a log, each redacted whole before it is cut to `LINE_CHARS` (`excerpt`)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            start = max(0, size - 16_384)
            handle.seek(start)
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ["(no log)"]
    found = text.splitlines()
    if start > 0 and found:
        found = found[1:]  # cut by the byte window: its start (a secret's prefix, perhaps) is not in view
    kept = [excerpt(line.rstrip(), LINE_CHARS) for line in found if line.strip()]
    return kept[-lines:] or ["(empty log)"]


def waiting_on(pids: Mapping[str, int], logs: Mapping[str, Path], request: RequestSpec, waited_s: float) -> str:
    """The reason text of a hang: the request in flight, then per role its processes and its last log lines."""
    lines = [
        f"request in flight: POST {request.url} (max_tokens {request.max_tokens}), no answer after {waited_s:.1f} s",
    ]
    for role, pid in pids.items():
        tree = _tree(pid)
        lines.append(f"{role}:")
        if not tree:
            lines.append(f"  pid {pid}: exited")
        for proc in tree[:MAX_PROCESSES]:
            lines.append(f"  {_process_line(proc)}")
        if len(tree) > MAX_PROCESSES:
            lines.append(f"  ... {len(tree) - MAX_PROCESSES} more processes")
        if role in logs:
            lines.extend(f"  log| {line}" for line in _log_tail(logs[role]))
    return "\n".join(lines)
