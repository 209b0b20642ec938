"""`matrix.launch.procenv`: the /proc reading that picks which processes the sweeps look at through psutil."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from matrix.launch.procenv import candidates, environ_value
from matrix.launch.supervisor import CELL_ENV, find_cell_processes
from matrix.launch.watchdog import sweep

NAME = "MATRIX_TEST_PROCENV"


@pytest.fixture
def tagged() -> Iterator[subprocess.Popen[bytes]]:
    """A live process whose environment holds NAME=a b (first entry) among others."""
    env = {NAME: "a b", **{k: v for k, v in os.environ.items() if k != NAME}}
    script = "import time; print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE)
    try:
        # Popen returns once exec has begun, but the kernel fills /proc/PID/environ a moment later (it read
        # empty once in CI): wait until the child runs its own code.
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_the_process_carrying_the_variable_is_a_candidate(tagged: subprocess.Popen[bytes]) -> None:
    assert tagged.pid in candidates(NAME, "a b")
    assert tagged.pid in candidates(NAME)  # any value


def test_another_value_or_a_prefix_of_the_name_is_not(tagged: subprocess.Popen[bytes]) -> None:
    assert tagged.pid not in candidates(NAME, "a")  # a prefix of the value
    assert tagged.pid not in candidates(NAME[:-1])  # a prefix of the name
    assert tagged.pid not in candidates(NAME + "_X")


def test_processes_without_it_are_not(tagged: subprocess.Popen[bytes]) -> None:
    plain_env = {k: v for k, v in os.environ.items() if k != NAME}
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=plain_env)
    try:
        found = candidates(NAME, "a b")
    finally:
        plain.kill()
        plain.wait()
    assert tagged.pid in found
    assert plain.pid not in found and os.getpid() not in found


# A child that overwrites the start of its own environment block with NULs, as setproctitle does when vLLM
# renames its engine core ("VLLM::EngineCore"): /proc then shows the block starting with NULs. Everything
# before NAME goes; with `--all` NAME too. With `--child` it first starts a grandchild in its process group
# that does the same with `--all` (a process whose tag nothing can read). Prints its pids once done.
_RENAMED = r"""
import os, subprocess, sys, time
def clobber(everything):
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of proc(5), from 3
    block = open("/proc/self/environ", "rb").read()
    length = end - start if everything else block.index(sys.argv[1].encode() + b"=")
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(b"\0" * length)
pids = [os.getpid()]
if "--child" in sys.argv:
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1], sys.argv[2], "--all"],
                             stdout=subprocess.PIPE)
    pids += [int(p) for p in child.stdout.readline().split()]
clobber("--all" in sys.argv)
print(*pids, flush=True)
time.sleep(60)
"""


TAG = f"cell-renamed-{os.getpid()}"


@pytest.fixture
def renamed() -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    """A tagged process in a session of its own, its environment's start overwritten, and an untaggable
    grandchild in its group (its pids in that order)."""
    env = {**{k: v for k, v in os.environ.items() if k != CELL_ENV}, CELL_ENV: TAG}  # the tag last, as ours are
    proc = subprocess.Popen([sys.executable, "-c", _RENAMED, CELL_ENV, _RENAMED, "--child"], env=env,
                            stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, pids
        yield proc, pids
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_renamed_process_keeps_its_tag_where_psutil_sees_no_environment(
    renamed: tuple[subprocess.Popen[bytes], list[int]],
) -> None:
    _, (pid, grandchild) = renamed
    assert psutil.Process(pid).environ() == {}  # why the sweeps no longer ask psutil
    assert environ_value(pid, CELL_ENV) == TAG
    assert pid in candidates(CELL_ENV, TAG)
    assert environ_value(pid, "PATH") is None  # gone with the overwritten start
    assert environ_value(grandchild, CELL_ENV) is None


def test_the_sweeps_find_a_renamed_process_and_the_watchdog_takes_its_group(
    renamed: tuple[subprocess.Popen[bytes], list[int]],
) -> None:
    proc, (pid, grandchild) = renamed
    assert [p.pid for p in find_cell_processes(TAG)] == [pid]
    assert sweep(TAG) == 1  # the tagged process, and with its group the grandchild nothing could find
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and time.monotonic() < deadline:  # reaped by init once killed
        time.sleep(0.05)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_a_tagged_process_in_a_group_that_is_not_the_cells_is_killed_alone() -> None:
    """The group goes only with a leader of the cell: here the leader carries no tag (as a test's or a
    shell's group would not), so the sweep kills the tagged child and leaves the leader."""
    env = {k: v for k, v in os.environ.items() if k != CELL_ENV}
    script = (
        "import os, subprocess, sys, time\n"
        f"env = {{**os.environ, {CELL_ENV!r}: {TAG!r}}}\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], env=env)\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"
        "time.sleep(60)\n"
    )  # fmt: skip
    leader = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        deadline = time.monotonic() + 10
        while environ_value(child, CELL_ENV) != TAG and time.monotonic() < deadline:  # until exec filled /proc
            time.sleep(0.02)
        assert sweep(TAG) == 1
        while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert leader.poll() is None, "the untagged leader of the group was killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
