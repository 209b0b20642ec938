"""The processes of an environment build (pip, uv, venv): tagged, interruptible, swept when orphaned.

Every build command runs in its own session with `MATRIX_PROVISION_OWNER=HOST:PID` (the runner) in its
environment, which its children (pip's build backends) inherit. So:

* a stop request (SIGINT/SIGTERM caught by the runner) or Ctrl-C ends the whole group, and the caller
  removes the half-built directory;
* a runner killed with SIGKILL: its build watchdog (`matrix.launch.watchdog`, one per runner process,
  started with its first build command) sees the runner's end of a pipe close and kills every process
  with the runner's tag at once, as a cell's watchdog does the cell's processes. Should the watchdog be
  gone too, the next `matrix run` or `matrix runtime provision` on this host finds them by the tag and
  kills them (`sweep_orphans`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

import psutil

from matrix.launch.procenv import candidates, environ_value

OWNER_ENV = "MATRIX_PROVISION_OWNER"
# How often a running build command checks for a stop request.
_POLL_S = 0.2
# Time a build command gets to exit after SIGTERM before its group is killed.
_GRACE_S = 5.0

StopCheck = Callable[[], bool]


class BuildInterrupted(BaseException):
    """The runner was asked to stop while an environment was being built."""


def owner_tag() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def never() -> bool:
    return False


# The build watchdog of this process: (pid it was started for, the write end of its pipe, the watchdog).
# Keyed by pid so that a forked child starts its own instead of trusting its parent's.
_watchdog: tuple[int, int, subprocess.Popen[bytes]] | None = None
_watchdog_lock = threading.Lock()


def _ensure_watchdog(env: Mapping[str, str]) -> None:
    """Start this runner's build watchdog once: it holds the read end of a pipe whose only write end this
    process keeps open for its whole life, so however the process ends (a SIGKILL included) the kernel
    closes it, and the watchdog kills every build process carrying this runner's tag."""
    global _watchdog
    from matrix.launch import watchdog

    with _watchdog_lock:
        if _watchdog is not None and _watchdog[0] == os.getpid():
            return
        read_fd, write_fd = os.pipe()  # not inheritable: the build commands do not hold the write end
        clean = {k: v for k, v in env.items() if k not in (OWNER_ENV, watchdog.CELL_ENV)}  # not swept itself
        argv = watchdog.watchdog_argv(read_fd, owner_tag(), env_name=OWNER_ENV)
        try:
            popen = subprocess.Popen(
                [sys.executable, "-I", watchdog.__file__, *argv], pass_fds=(read_fd,), env=clean,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError:
            os.close(write_fd)
            return  # no watchdog: the next run's `sweep_orphans` finds a killed runner's builds, as before
        finally:
            os.close(read_fd)
        _watchdog = (os.getpid(), write_fd, popen)


def _end_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the command's process group, a grace period, then SIGKILL whatever of the group is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_GRACE_S)


def run_command(
    argv: Sequence[str],
    *,
    stdout: int | IO[str],
    stderr: IO[str],
    env: Mapping[str, str],
    timeout_s: float,
    stop: StopCheck = never,
) -> subprocess.CompletedProcess[str]:
    """Run one build command to its end, or end its whole process group on a stop request, Ctrl-C or
    timeout (raising `BuildInterrupted`, `KeyboardInterrupt` or `subprocess.TimeoutExpired`)."""
    _ensure_watchdog(env)
    tagged = {**env, OWNER_ENV: owner_tag()}
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(
        list(argv), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=tagged, text=True,
        start_new_session=True,  # one group to end; a terminal's Ctrl-C reaches the runner, which ends it
    )  # fmt: skip
    try:
        while True:
            try:
                out, _ = proc.communicate(timeout=_POLL_S)
                return subprocess.CompletedProcess(list(argv), proc.returncode, out, None)
            except subprocess.TimeoutExpired:
                pass
            if stop():
                raise BuildInterrupted(f"stopped while running `{argv[0]}`")
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(list(argv), timeout_s)
    except BaseException:
        _end_group(proc)
        raise


def kill_tagged(wanted: Callable[[str], bool], timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every live process whose `MATRIX_PROVISION_OWNER` tag satisfies `wanted`; their pids."""
    killed: list[psutil.Process] = []
    for pid in candidates(OWNER_ENV):
        try:
            proc = psutil.Process(pid)
            tag = environ_value(pid, OWNER_ENV)
            if tag is None or proc.status() == psutil.STATUS_ZOMBIE or not wanted(tag):
                continue
            proc.kill()  # psutil checks the pid still names the same process before signalling
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        killed.append(proc)
    psutil.wait_procs(killed, timeout=timeout_s)
    return [proc.pid for proc in killed]


def sweep_orphans() -> list[int]:
    """Kill the build processes of runners on this host that are gone (a SIGKILLed `matrix run`)."""
    host = socket.gethostname()

    def orphaned(tag: str) -> bool:
        owner_host, _, pid = tag.rpartition(":")
        return owner_host == host and pid.isdigit() and not psutil.pid_exists(int(pid))

    return kill_tagged(orphaned)
