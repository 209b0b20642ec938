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

A cell whose processes run in containers passes the container engine too (`--engine ENGINE`): after the
sweep the watchdog force-removes every container labelled with the cell, since a container's processes
belong to the engine's daemon, not to the runner (the sweep reaches them only when the daemon runs on this
very kernel and shows them in this pid namespace). Last it removes the plan's scratch directories
(`--remove DIR`, one per directory: the cell's TMPDIR, discovery and cache directories), which the runner's
teardown would have removed; only once nothing of the cell runs, so no process writes into them any more.

An environment build (pip, uv) is watched the same way (`--env MATRIX_PROVISION_OWNER`, `matrix.launch.
providers.buildprocs`): the tag is then the runner's provisioning owner tag instead of a cell id, so a build
orphaned by a SIGKILLed runner is killed at once instead of by the next provision on the host.

Run as a script (`python -I watchdog.py FD CELL_ID [--env NAME] [--engine ENGINE] [--remove DIR]...`); it imports only
the standard library and psutil, so it starts fast and does not depend on how matrix itself was put on the
path.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

CELL_ENV = "MATRIX_CELL_ID"
CELL_LABEL = "matrix.cell"  # the container provider's label (a script: it cannot import matrix)
_ENGINE_TIMEOUT_S = 30.0
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


def tag_of(pid: int, env_name: str = CELL_ENV) -> str | None:
    """`env_name`'s value in the environment block /proc shows for `pid` (None: none, or unreadable).

    Read here, not through psutil's `Process.environ()`: a process that renames itself as vLLM's engine core
    and workers do (setproctitle) overwrites the start of that block with NULs, which psutil takes for its
    end, so it sees no variable at all while the tag further on is intact (`matrix.launch.procenv`, which
    this script cannot import, says the same).
    """
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            environ = file.read()
    except OSError:
        return None
    prefix = f"{env_name}=".encode("utf-8", "surrogateescape")
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode("utf-8", "surrogateescape")
    return None


def _kill_group(pid: int, cell_id: str, env_name: str) -> None:
    """SIGKILL `pid`'s process group when its leader is of the cell too: the supervisor starts each process of
    a cell in a session of its own, whose group takes along any child whose tag cannot be read. A tagged
    process in someone else's group (a test's, a shell's) is killed alone: its group is not the cell's."""
    try:
        group = os.getpgid(pid)
        if group > 1 and group != os.getpgrp() and tag_of(group, env_name) == cell_id:
            os.killpg(group, signal.SIGKILL)
    except OSError:
        pass


def sweep(cell_id: str, env_name: str = CELL_ENV) -> int:
    """SIGKILL every process of the cell (whose `env_name` is `cell_id`) and, where its leader is of the cell,
    its process group, again and again for a moment (a dying parent may still fork)."""
    import psutil

    killed: set[int] = set()
    deadline = time.monotonic() + _SWEEP_FOR_S
    while True:
        found = 0
        for proc in psutil.process_iter():
            if proc.pid == os.getpid() or tag_of(proc.pid, env_name) != cell_id:
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                _kill_group(proc.pid, cell_id, env_name)
                proc.kill()
            except (psutil.Error, OSError):
                continue
            found += 1
            killed.add(proc.pid)
        if not found or time.monotonic() >= deadline:
            return len(killed)
        time.sleep(0.05)


def remove_containers(engine: str, cell_id: str) -> int:
    """Force-remove every container labelled with the cell (running or not); how many there were."""
    path = shutil.which(engine)
    if path is None:
        return 0
    try:
        listed = subprocess.run(
            [path, "ps", "--all", "--quiet", "--filter", f"label={CELL_LABEL}={cell_id}"],
            capture_output=True, text=True, timeout=_ENGINE_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        ids = listed.stdout.split()
        if ids:
            subprocess.run([path, "rm", "--force", *ids], capture_output=True, timeout=_ENGINE_TIMEOUT_S,
                           check=False, stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len(ids)


def watchdog_argv(
    fd: int, cell_id: str, engine: str = "", remove: tuple[str, ...] = (), env_name: str = CELL_ENV
) -> list[str]:
    """The script's arguments after its path."""
    return [
        str(fd), cell_id, *(["--env", env_name] if env_name != CELL_ENV else []),
        *(["--engine", engine] if engine else []), *(a for d in remove for a in ("--remove", d)),
    ]  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="watchdog.py")
    parser.add_argument("fd", type=int)
    parser.add_argument("cell_id")
    parser.add_argument("--env", default=CELL_ENV)
    parser.add_argument("--engine", default="")
    parser.add_argument("--remove", action="append", default=[])
    args = parser.parse_args(argv[1:])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the runner, which tears down itself
    if _read_until_eof(args.fd).strip() == DONE:
        return 0
    sweep(args.cell_id, args.env)
    if args.engine:
        remove_containers(args.engine, args.cell_id)
    for directory in args.remove:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
