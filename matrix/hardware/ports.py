"""Collision-free TCP ports for cells that run side by side.

Fixed ports collide as soon as two cells (or two runners) share a host, so every port a cell uses is
allocated here. A port is handed out only if

* no allocator in this process holds it,
* no live entry in the registry file holds it: the registry is shared by every runner on the host
  (`matrix.paths.port_registry_path`, whatever their data directories), guarded by `fcntl.flock`, and its
  entries expire when their TTL passes or their process is gone, so a crashed runner never leaks ports
  for long,
* binding it succeeds right now.

Ports in the kernel's ephemeral range are avoided when the requested range allows it: an outgoing
connection can take such a port between allocation and the server's bind, which is a classic source of
"Address already in use" under parallel runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import psutil

from matrix.errors import MatrixError

_log = logging.getLogger(__name__)

# Bind attempts per requested port before giving up.
_MAX_TRIES = 200
# When a request's max_port lies below the allocator's min_port, search this many ports below max_port.
_FALLBACK_SPAN = 10_000
# Ports below this need privileges (or belong to well-known services).
_LOWEST_PORT = 1024
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@dataclass(frozen=True)
class PortRequest:
    """One named port of a cell; `max_port` caps it (Dynamo's Rust side rejects ports above 32767)."""

    name: str
    max_port: int = 65535

    def __post_init__(self) -> None:
        if not _LOWEST_PORT < self.max_port <= 65535:
            raise ValueError(f"max_port of {self.name!r} must lie in {_LOWEST_PORT + 1}..65535")


class _Entry(TypedDict):
    owner: str
    pid: int
    host: str
    expires: float


def port_is_free(port: int, *, reuse_addr: bool = False) -> bool:
    """Return whether `port` can be bound on all IPv4 interfaces right now.

    Binding the wildcard address conflicts with a socket on any local address, so this is stricter than
    binding 127.0.0.1. Without `reuse_addr` even connections lingering in TIME_WAIT count as busy (what
    allocation wants: a server that does not set SO_REUSEADDR must be able to bind); with it only
    listeners count (what a post-teardown check wants: is anything still serving there).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse_addr))
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out ports to owners (cells) and keeps them reserved until `release` or expiry."""

    def __init__(self, registry_path: Path, *, ttl_s: float = 6 * 3600, min_port: int = 20000) -> None:
        self._registry_path = registry_path
        # A separate lock file: the registry itself is replaced on every write, so a lock on it would
        # guard an inode that is about to be unlinked.
        self._lock_path = registry_path.with_name(registry_path.name + ".lock")
        self._ttl_s = ttl_s
        self._min_port = max(min_port, _LOWEST_PORT + 1)
        self._host = _host_id()
        self._ephemeral = _ephemeral_range()
        self._mutex = threading.Lock()
        self._reserved: dict[str, set[int]] = {}
        self._rng = random.Random()  # seeded from os.urandom, so runners draw different sequences

    def allocate(self, owner: str, requests: Sequence[PortRequest]) -> dict[str, int]:
        """Reserve one distinct, currently bindable port per request; return them by request name.

        Raises `MatrixError` when a request's range holds no free port.
        """
        names = [request.name for request in requests]
        if len(set(names)) != len(names):
            raise ValueError(f"port names must be unique within one allocation: {names}")
        with self._mutex, self._registry_lock():
            entries = self._load()
            taken = {int(port) for port in entries} | self._reserved_ports()
            chosen: dict[str, int] = {}
            for request in requests:
                port = self._pick(request, taken)
                taken.add(port)
                chosen[request.name] = port
            expires = time.time() + self._ttl_s
            for port in chosen.values():
                entries[str(port)] = _Entry(owner=owner, pid=os.getpid(), host=self._host, expires=expires)
            self._save(entries)
            self._reserved.setdefault(owner, set()).update(chosen.values())
        return chosen

    def release(self, owner: str) -> None:
        """Return every port this process reserved for `owner`; unknown owners are ignored."""
        with self._mutex, self._registry_lock():
            self._reserved.pop(owner, None)
            entries = self._load()
            mine = {
                port
                for port, entry in entries.items()
                if entry["owner"] == owner and entry["pid"] == os.getpid() and entry["host"] == self._host
            }
            self._save({port: entry for port, entry in entries.items() if port not in mine})

    def _reserved_ports(self) -> set[int]:
        return set().union(*self._reserved.values())

    def _pick(self, request: PortRequest, taken: set[int]) -> int:
        low, high = self._bounds(request)
        for port in self._candidates(low, high):
            if port not in taken and port_is_free(port):
                return port
        raise MatrixError(
            f"no free port for {request.name!r} in {low}..{high} after {_MAX_TRIES} tries; "
            f"free some ports or remove stale entries from {self._registry_path}"
        )

    def _bounds(self, request: PortRequest) -> tuple[int, int]:
        if self._min_port <= request.max_port:
            return self._min_port, request.max_port
        return max(_LOWEST_PORT + 1, request.max_port - _FALLBACK_SPAN), request.max_port

    def _candidates(self, low: int, high: int) -> Iterator[int]:
        """Yield up to `_MAX_TRIES` distinct random ports, those outside the ephemeral range first."""
        preferred = _subtract(range(low, high + 1), self._ephemeral)
        seen: set[int] = set()
        for ranges in (preferred, [range(low, high + 1)]):
            total = sum(len(part) for part in ranges)
            for index in self._rng.sample(range(total), min(total, _MAX_TRIES)):
                port = _nth(ranges, index)
                if port not in seen:
                    seen.add(port)
                    yield port
                if len(seen) >= _MAX_TRIES:
                    return

    @contextlib.contextmanager
    def _registry_lock(self) -> Iterator[None]:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes
            yield

    def _load(self) -> dict[str, _Entry]:
        """Read the registry, dropping malformed and stale entries (expired, or their process is gone)."""
        try:
            raw: Any = json.loads(self._registry_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (ValueError, UnicodeDecodeError):
            # Writes are atomic, so this is damage from outside; starting over only risks a collision
            # with a port whose owner will then fail its bind, which beats refusing to run at all.
            _log.warning("port registry %s is unreadable; starting a new one", self._registry_path)
            return {}
        if not isinstance(raw, dict):
            return {}
        now = time.time()
        return {
            port: entry
            for port, entry in raw.items()
            if port.isdigit() and _is_entry(entry) and self._is_live(entry, now)
        }

    def _is_live(self, entry: _Entry, now: float) -> bool:
        if entry["expires"] <= now:
            return False
        # A pid can only be checked on its own host; entries from other hosts live until they expire.
        return entry["host"] != self._host or psutil.pid_exists(entry["pid"])

    def _save(self, entries: dict[str, _Entry]) -> None:
        """Write atomically, so a reader never sees half a file even if this process dies mid-write."""
        self._registry_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=self._registry_path.parent, prefix=".ports-", delete=False
        ) as handle:
            json.dump(entries, handle, indent=1, sort_keys=True)
        os.replace(handle.name, self._registry_path)


def _is_entry(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("owner"), str)
        and isinstance(value.get("pid"), int)
        and isinstance(value.get("host"), str)
        and isinstance(value.get("expires"), int | float)
    )


def _host_id() -> str:
    """Where a pid means something: the host name plus the pid namespace.

    Containers that share the host's network (and so its ports and often its host name) but not its pid
    namespace must not judge each other's entries by pid.
    """
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        return socket.gethostname()
    return f"{socket.gethostname()}/{namespace}"


def _ephemeral_range() -> range:
    """The kernel's range for outgoing connections' local ports (empty where it cannot be read)."""
    try:
        low, high = (int(part) for part in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return range(0)
    return range(low, high + 1)


def _subtract(ports: range, hole: range) -> list[range]:
    """`ports` without `hole`, as up to two ranges."""
    if not hole:
        return [ports]
    parts = [range(ports.start, min(ports.stop, hole.start)), range(max(ports.start, hole.stop), ports.stop)]
    return [part for part in parts if part]


def _nth(ranges: list[range], index: int) -> int:
    """The `index`-th port of the concatenation of `ranges`."""
    for part in ranges:
        if index < len(part):
            return part[index]
        index -= len(part)
    raise IndexError(index)
