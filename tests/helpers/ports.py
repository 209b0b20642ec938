"""Ports for tests: a free loopback port, a free block, and a process that holds ports."""

from __future__ import annotations

import itertools
import random

from matrix.hardware.ports import port_is_free

# Where `free_port` looks: below the kernel's ephemeral range (32768 and up by default), as matrix's own
# allocator prefers. A port the kernel hands out (bind to 0) and the test closes again can be given to any
# process's next outgoing connection before the server under test binds it; with four test workers making
# loopback connections, a reference prefill once failed so ("Address already in use" on its side channel, CI).
FREE_PORT_RANGE = range(20000, 32000)


def free_port() -> int:
    """A port free on every interface right now, picked at random outside the ephemeral range."""
    for port in random.sample(FREE_PORT_RANGE, 200):
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port in {FREE_PORT_RANGE.start}..{FREE_PORT_RANGE.stop - 1} after 200 tries")


def free_block(size: int) -> int:
    """First port of `size` consecutive free ports below the usual ephemeral range.

    The search starts at a random place so that test sessions running side by side rarely pick the same
    block.
    """
    start = random.randrange(24000, 32000)
    for low in itertools.chain(range(start, 32000, size), range(24000, start, size)):
        if all(port_is_free(port) for port in range(low, low + size)):
            return low
    raise RuntimeError("no free block of ports for the test")


# Holds `count` ports from `low` on for a parent test: prints them, then waits for stdin to close.
HOLDER = """
import sys
from pathlib import Path
from matrix.hardware.ports import PortAllocator, PortRequest
allocator = PortAllocator(Path(sys.argv[1]), min_port=int(sys.argv[2]))
count, max_port = int(sys.argv[3]), int(sys.argv[4])
ports = allocator.allocate("holder", [PortRequest(f"p{i}", max_port) for i in range(count)])
print(" ".join(map(str, ports.values())), flush=True)
sys.stdin.read()
"""
