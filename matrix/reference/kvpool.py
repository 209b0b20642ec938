"""A bounded KV-block pool and the side channel that moves blocks from prefill to decode.

The pool lives in one preallocated buffer (an anonymous mmap on CPU, a uint8 tensor on the GPU), so a
worker's KV cache really occupies the memory it was told to use, and running out of it is a real error.
The side channel is pull-mode like NIXL's READ: decode connects to prefill, names a handle and reads
the blocks; prefill frees them once they were sent.

Wire protocol (all integers big-endian):
  request:  u32 handle length, handle bytes (UTF-8)
  response: u8 status; status 0: u32 num_blocks, u32 block_bytes, then num_blocks * block_bytes bytes;
            status 1: u32 message length, message bytes (UTF-8)
"""

from __future__ import annotations

import hashlib
import importlib
import mmap
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

MAX_HANDLE_BYTES = 1024
_OK, _ERROR = 0, 1


class Storage(Protocol):
    """Raw bytes behind the pool."""

    def write(self, offset: int, data: bytes) -> None: ...
    def read(self, offset: int, length: int) -> bytes: ...
    def close(self) -> None: ...


class CpuStorage:
    """An anonymous mmap: allocated at once, but pages are only touched as blocks are written."""

    def __init__(self, size: int) -> None:
        self._buf = mmap.mmap(-1, size)

    def write(self, offset: int, data: bytes) -> None:
        self._buf[offset : offset + len(data)] = data

    def read(self, offset: int, length: int) -> bytes:
        return self._buf[offset : offset + length]

    def close(self) -> None:
        self._buf.close()


class DeviceUnavailableError(RuntimeError):
    """`--device cuda` was asked for but torch with CUDA cannot be used here."""


class CudaStorage:
    """A preallocated uint8 tensor on the current CUDA device, so the GPU memory is really held."""

    def __init__(self, size: int) -> None:
        # Imported lazily and untyped: torch is optional and costs seconds to import.
        try:
            torch: Any = importlib.import_module("torch")
        except ImportError as exc:
            raise DeviceUnavailableError(f"--device cuda needs torch, which cannot be imported: {exc}") from exc
        if not torch.cuda.is_available():
            raise DeviceUnavailableError("--device cuda: torch is installed but reports no usable CUDA device")
        self._torch = torch
        # zeros, not empty: the allocation is written, so the memory is committed on the device now.
        self._tensor: Any = torch.zeros(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

    def write(self, offset: int, data: bytes) -> None:
        src = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8)
        self._tensor[offset : offset + len(data)].copy_(src)

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        # frombuffer shares `out`'s memory, so the device-to-host copy lands straight in it.
        self._torch.frombuffer(out, dtype=self._torch.uint8).copy_(self._tensor[offset : offset + length])
        return bytes(out)

    def close(self) -> None:
        self._tensor = None
        self._torch.cuda.empty_cache()


def make_storage(device: str, size: int) -> Storage:
    """The storage for `--device`; raises DeviceUnavailableError when CUDA cannot be used."""
    if device == "cuda":
        return CudaStorage(size)
    return CpuStorage(size)


class PoolFullError(Exception):
    """Not enough free blocks; the message is what the worker returns to the client."""

    def __init__(self, needed: int, free: int, total: int, what: str = "prompt") -> None:
        super().__init__(f"{what} needs {needed} bytes of KV cache, pool has {free} free of {total}")


class DuplicateHandleError(Exception):
    """A handle that is already in the pool (request ids must be unique)."""


@dataclass
class _Entry:
    runs: list[tuple[int, int]]  # (first block, count), in the order of the request's tokens
    checksum: str
    expires_at: float


def checksum(data: bytes) -> str:
    """The checksum that travels with a KV handle and is verified after the transfer."""
    return hashlib.sha256(data).hexdigest()


# Merge adjacent free runs once this many have piled up, so fragmentation stays bounded.
_COALESCE_AT = 1024


class KVPool:
    """Fixed-size blocks in one buffer, handed out per request handle and freed on pull or TTL.

    Free space is kept as runs of consecutive blocks, not one entry per block: a realistic 1 GiB pool
    of 64-byte blocks has 16 M blocks, far too many for a Python list, and runs also mean one copy
    per run instead of one per block (which matters for device memory).
    """

    def __init__(
        self,
        storage: Storage,
        total_bytes: int,
        block_bytes: int,
        ttl_s: float = 60.0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.block_bytes = block_bytes
        self.num_blocks = total_bytes // block_bytes
        self.ttl_s = ttl_s
        self._storage = storage
        self._log = log or (lambda _msg: None)
        self._free_runs: list[tuple[int, int]] = [(0, self.num_blocks)]
        self._free_blocks = self.num_blocks
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_blocks * self.block_bytes

    def _sweep(self) -> None:
        now = time.monotonic()
        for handle in [h for h, e in self._entries.items() if e.expires_at <= now]:
            self._release(handle)
            self._log(f"kv handle={handle} expired after {self.ttl_s:g}s")

    def _allocate(self, count: int) -> list[tuple[int, int]]:
        runs: list[tuple[int, int]] = []
        while count:
            first, size = self._free_runs.pop()
            take = min(size, count)
            runs.append((first, take))
            if take < size:
                self._free_runs.append((first + take, size - take))
            count -= take
        return runs

    def _release(self, handle: str) -> bool:
        entry = self._entries.pop(handle, None)
        if entry is None:
            return False
        self._free_runs.extend(entry.runs)
        self._free_blocks += sum(n for _f, n in entry.runs)
        if len(self._free_runs) >= _COALESCE_AT:
            merged: list[tuple[int, int]] = []
            for first, size in sorted(self._free_runs):
                if merged and merged[-1][0] + merged[-1][1] == first:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((first, size))
            # Highest first, so pops from the end hand out low, ascending blocks.
            self._free_runs = merged[::-1]
        return True

    def put(self, handle: str, blocks: list[bytes], what: str = "prompt") -> str:
        """Store the blocks under `handle`; return their checksum. Raises PoolFullError."""
        if any(len(b) != self.block_bytes for b in blocks):
            raise ValueError("every block must be exactly block_bytes long")
        data = b"".join(blocks)
        with self._lock:
            self._sweep()
            if handle in self._entries:
                raise DuplicateHandleError(f"KV handle {handle!r} is already in the pool")
            if len(blocks) > self._free_blocks:
                free = self._free_blocks * self.block_bytes
                raise PoolFullError(len(data), free, self.capacity_bytes, what)
            runs = self._allocate(len(blocks))
            self._free_blocks -= len(blocks)
            pos = 0
            for first, count in runs:
                size = count * self.block_bytes
                self._storage.write(first * self.block_bytes, data[pos : pos + size])
                pos += size
            digest = checksum(data)
            self._entries[handle] = _Entry(runs, digest, time.monotonic() + self.ttl_s)
            return digest

    def get(self, handle: str) -> bytes | None:
        """The blocks stored under `handle`, read back from the buffer, or None if unknown or expired."""
        with self._lock:
            self._sweep()
            entry = self._entries.get(handle)
            if entry is None:
                return None
            bb = self.block_bytes
            return b"".join(self._storage.read(first * bb, count * bb) for first, count in entry.runs)

    def sweep(self) -> None:
        """Release what expired (put and get also do it): the usage gauge then reads the real level."""
        with self._lock:
            self._sweep()

    def free(self, handle: str) -> bool:
        """Give the handle's blocks back; False if it was not there."""
        with self._lock:
            return self._release(handle)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._free_runs = []
            self._free_blocks = 0
            self._storage.close()


# ---------------------------------------------------------------------------------------------------
# Side channel


class KVTransferError(Exception):
    """The pull failed: refused, unknown handle, short read or bad reply."""


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise KVTransferError(f"connection closed after {len(buf)} of {n} bytes of {what}")
        buf += chunk
    return bytes(buf)


def pull_blocks(host: str, port: int, handle: str, timeout_s: float | None = 30.0) -> tuple[int, int, bytes]:
    """Fetch a handle's blocks from a prefill worker: (num_blocks, block_bytes, data)."""
    raw = handle.encode("utf-8")
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack(">I", len(raw)) + raw)
            status = _recv_exact(sock, 1, "status")[0]
            if status != _OK:
                (length,) = struct.unpack(">I", _recv_exact(sock, 4, "error length"))
                message = _recv_exact(sock, min(length, 65536), "error message").decode("utf-8", "replace")
                raise KVTransferError(message)
            num_blocks, block_bytes = struct.unpack(">II", _recv_exact(sock, 8, "header"))
            data = _recv_exact(sock, num_blocks * block_bytes, "KV blocks")
            return num_blocks, block_bytes, data
    except OSError as exc:
        raise KVTransferError(f"side channel {host}:{port}: {exc}") from exc


class SideChannelServer(socketserver.ThreadingTCPServer):
    """Serves pulls from one pool; `drop_mid_transfer` is the kv-transfer-dropped fault, `stall` kv-transfer-stall,
    `keep_after_pull` kv-read-report-lost."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(
        self, port: int, pool: KVPool, log: Callable[[str], None], drop_mid_transfer: bool, stall: bool = False,
        keep_after_pull: bool = False,
    ) -> None:  # fmt: skip
        self.pool = pool
        self.log = log
        self.drop_mid_transfer = drop_mid_transfer
        self.stall = stall
        self.keep_after_pull = keep_after_pull
        # Never set: a stalled pull waits on it until the process exits (the handler threads are daemons).
        self.stalled = threading.Event()
        super().__init__(("127.0.0.1", port), _PullHandler)


class _PullHandler(socketserver.BaseRequestHandler):
    server: SideChannelServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(30.0)
        srv = self.server
        try:
            (length,) = struct.unpack(">I", _recv_exact(sock, 4, "handle length"))
            if length > MAX_HANDLE_BYTES:
                self._error(sock, f"handle too long ({length} bytes)")
                return
            handle = _recv_exact(sock, length, "handle").decode("utf-8", "replace")
            data = srv.pool.get(handle)
            if data is None:
                srv.log(f"side-channel pull handle={handle} unknown")
                self._error(sock, f"unknown KV handle {handle!r} (never stored, already pulled or expired)")
                return
            num_blocks = len(data) // srv.pool.block_bytes
            if srv.stall:
                srv.log(f"side-channel pull handle={handle} stalled: never answering (fault kv-transfer-stall)")
                srv.stalled.wait()
                return
            header = bytes([_OK]) + struct.pack(">II", num_blocks, srv.pool.block_bytes)
            if srv.drop_mid_transfer:
                # Fault: half the blocks, then a hard close, as when a NIXL agent dies mid-READ.
                sock.sendall(header + data[: len(data) // 2])
                srv.log(f"side-channel pull handle={handle} dropped mid-transfer (fault kv-transfer-dropped)")
                sock.shutdown(socket.SHUT_RDWR)
                return
            sock.sendall(header + data)
            if srv.keep_after_pull:
                # As a NIXL prefill that never gets decode's "done reading": the blocks wait for the TTL.
                srv.log(f"side-channel pull handle={handle} sent {num_blocks} blocks, kept until the KV TTL "
                        "(fault kv-read-report-lost)")  # fmt: skip
                return
            srv.pool.free(handle)
            srv.log(f"side-channel pull handle={handle} sent {num_blocks} blocks, freed")
        except (OSError, KVTransferError) as exc:
            srv.log(f"side-channel error: {exc}")

    @staticmethod
    def _error(sock: socket.socket, message: str) -> None:
        raw = message.encode("utf-8")
        sock.sendall(bytes([_ERROR]) + struct.pack(">I", len(raw)) + raw)
