"""The port registry against real processes that hold ports, die, or leave stale entries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from matrix.errors import MatrixError
from matrix.hardware.ports import PortAllocator, PortRequest
from tests.helpers.ports import HOLDER, free_block

pytestmark = pytest.mark.e2e


@pytest.fixture
def holder(registry: Path) -> Iterator[tuple[subprocess.Popen[str], range]]:
    """Another runner process holding every port of a small block."""
    low = free_block(4)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(registry), str(low), "4", str(low + 3)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    held = sorted(map(int, proc.stdout.readline().split()))
    assert held == list(range(low, low + 4))
    yield proc, range(low, low + 4)
    proc.kill()
    proc.wait()


def test_another_process_holding_ports_is_respected(
    registry: Path, holder: tuple[subprocess.Popen[str], range]
) -> None:
    _, block = holder
    allocator = PortAllocator(registry, min_port=block.start)
    with pytest.raises(MatrixError, match="no free port for 'x'"):
        allocator.allocate("cell", [PortRequest("x", max_port=block.stop - 1)])
    # Outside the held block the same allocator works, and never hands out a held port.
    ports = PortAllocator(registry).allocate("cell", [PortRequest(f"p{i}") for i in range(30)])
    assert not set(ports.values()) & set(block)


def test_ports_of_a_dead_process_are_reclaimed(registry: Path, holder: tuple[subprocess.Popen[str], range]) -> None:
    proc, block = holder
    proc.kill()
    proc.wait()
    allocator = PortAllocator(registry, min_port=block.start)
    ports = allocator.allocate("cell", [PortRequest(f"p{i}", max_port=block.stop - 1) for i in range(4)])
    assert sorted(ports.values()) == list(block)


def test_stale_entries_are_dropped_from_the_file(registry: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = PortAllocator(registry)
    host = live._host  # the allocator's own notion of "this host"
    registry.write_text(
        json.dumps(
            {
                "30001": {"owner": "dead", "pid": dead.pid, "host": host, "expires": time.time() + 60},
                "30002": {"owner": "expired", "pid": os.getpid(), "host": host, "expires": time.time() - 1},
                "30003": {"owner": "elsewhere", "pid": 1, "host": "other-host", "expires": time.time() + 60},
                "30004": {"owner": "garbage"},
            }
        )
    )
    live.allocate("cell", [PortRequest("a")])
    owners = {entry["owner"] for entry in json.loads(registry.read_text()).values()}
    assert owners == {"elsewhere", "cell"}
