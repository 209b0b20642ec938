"""The reference decode worker's faults that only concurrency shows ([M27]'s positive controls).

Each acts only while another decode is in flight on the same worker, so a pair asked one request at a time
(the primary request, the lifecycle checks, the equivalence oracle) passes, and only the traffic check's
concurrent load can catch it, as in the field:

- `stale-kv-after-reuse`: the decode generates from the previous request's blocks, as a consumer holding a
  stale reference after the producer reused its blocks (vllm #52234): HTTP 200 with another prompt's answer.
- `kv-swap-in-flight`: two in-flight decodes exchange their KV: each answers the other's prompt.
- `peer-loss-hang`: the decode loses the prefill peer that holds its KV and waits for it forever, without a
  timeout (sgl-project/sglang #29482); the frontend waits as long.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# How long an in-flight decode under kv-swap-in-flight waits for a partner to swap with.
SWAP_WAIT_S = 0.2


class ConcurrencyFaults:
    """The state those faults need: the last decode's blocks, a swap slot, a wait that never ends."""

    def __init__(self, faults: frozenset[str], block_bytes: int, log: Callable[[str], None]) -> None:
        self.faults, self.block_bytes, self.log = faults, block_bytes, log
        self._lock = threading.Lock()
        self._last: bytes = b""
        self._slot: tuple[str, threading.Event, list[bytes], bytes] | None = None
        self._never = threading.Event()  # never set: a lost peer's decode waits on it until the process exits

    def apply(self, handle: str, cached: bytes, running: int) -> bytes:
        """The blocks this decode generates from: its own, unless a fault acts on them under load."""
        with self._lock:
            previous, self._last = self._last, cached
        if running < 2:
            return cached
        if "peer-loss-hang" in self.faults:
            self.log(f"decode handle={handle} lost its prefill peer under load; waiting for the KV without a "
                     "timeout (fault peer-loss-hang)")  # fmt: skip
            self._never.wait()
        if "stale-kv-after-reuse" in self.faults and previous and previous != cached:
            self.log(f"decode handle={handle} reads the previous request's blocks (fault stale-kv-after-reuse)")
            return previous
        if "kv-swap-in-flight" in self.faults:
            return self._swap(handle, cached)
        return cached

    def _swap(self, handle: str, cached: bytes) -> bytes:
        with self._lock:
            slot = self._slot
            if slot is not None and slot[0] != handle:
                self._slot = None
                slot[2].append(cached)
                slot[1].set()
                self.log(f"decode handle={handle} swapped KV with handle={slot[0]} (fault kv-swap-in-flight)")
                return slot[3]
            mine: tuple[str, threading.Event, list[bytes], bytes] = (handle, threading.Event(), [], cached)
            self._slot = mine
        if mine[1].wait(SWAP_WAIT_S):
            return mine[2][0]
        with self._lock:
            if self._slot is mine:
                self._slot = None
                return cached
        mine[1].wait()  # a partner took the slot just now: its KV is on its way
        return mine[2][0]
