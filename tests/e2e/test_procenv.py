"""`matrix.launch.procenv`: the /proc reading that picks which processes the sweeps look at through psutil."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from matrix.launch.procenv import candidates

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
