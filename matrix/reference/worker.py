"""The prefill and decode workers: HTTP API on one port, KV side channel on another."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from matrix.reference import tokens
from matrix.reference.concurrency import ConcurrencyFaults
from matrix.reference.eventlog import EventLog
from matrix.reference.faults import AGGREGATED_FAULTS, DECODE_FAULTS, FLAKE_RATE_ENV, PREFILL_FAULTS, STATE_ENV
from matrix.reference.http import AppServer, HTTPError, JSONHandler, Route, StopSignal, serve_until_stopped
from matrix.reference.kvpool import (
    MAX_HANDLE_BYTES,
    DeviceUnavailableError,
    DuplicateHandleError,
    KVPool,
    KVTransferError,
    PoolFullError,
    SideChannelServer,
    checksum,
    make_storage,
    pull_blocks,
)

MAX_TOKENS_LIMIT = 65_536
# A streamed decode writes a token at most this often: fast, yet slow enough that a client can drop it
# mid-answer (the cancel check reads a few chunks first).
STREAM_TOKEN_S = 0.005
# Keeps the escaped-child fault's Popen object alive, so nothing reaps or warns about it.
_ESCAPED: list[object] = []


@dataclass(frozen=True)
class WorkerConfig:
    # "prefill", "decode", or "aggregated": one worker doing both phases from its own pool, no transfer
    # (the baseline of the equivalence oracle).
    role: str
    port: int
    side_channel_port: int
    kv_cache_bytes: int
    block_bytes: int
    device: str
    faults: frozenset[str]
    slow_start_s: float
    kv_ttl_s: float
    # Decode time per generated token, to model a real engine's steady state (0: as fast as possible).
    token_delay_s: float = 0.0


class WorkerApp:
    """Routes for one worker; the pool and instance id are fixed for the process's life."""

    def __init__(self, cfg: WorkerConfig, pool: KVPool, instance_id: int, log: EventLog) -> None:
        self.cfg = cfg
        self.pool = pool
        self.instance_id = instance_id
        self.log = log
        # The KV-transfer counters decode publishes on /metrics, named and shaped like an engine's, so the
        # KV ledger (`matrix.check.ledger`) reads the reference server as it reads vLLM and SGLang.
        self._kv_lock = threading.Lock()
        self.kv_transfers = 0
        self.kv_bytes = 0
        self.kv_seconds = 0.0
        # The same transfers per prefill peer (its instance id): the ledger of each (prefill, decode) pair.
        self.kv_by_peer: dict[str, list[float]] = {}
        # Scheduler gauges, named like vLLM's (`matrix.check.lifecycle` reads them): requests being served,
        # and decodes waiting for KV that did not come (handle -> when the wait ends; fault hold-orphan-decode).
        self.running = 0
        self.waiting_until: dict[str, float] = {}
        self.concurrency = ConcurrencyFaults(cfg.faults, cfg.block_bytes, log)

    def routes(self) -> dict[tuple[str, str], Route]:
        table: dict[tuple[str, str], Route] = {("GET", "/health"): self.health, ("GET", "/metrics"): self.metrics}
        if self.cfg.role in ("prefill", "aggregated"):
            table["POST", "/prefill"] = self.prefill
        if self.cfg.role in ("decode", "aggregated"):
            table["POST", "/decode"] = self.decode
        return table

    def health(self, req: JSONHandler) -> None:
        req.send_json(
            200,
            {
                "status": "ready",
                "role": self.cfg.role,
                "instance_id": self.instance_id,
                "kv_capacity_bytes": self.pool.capacity_bytes,
                "kv_free_bytes": self.pool.free_bytes,
            },
        )

    def metrics(self, req: JSONHandler) -> None:
        with self._kv_lock:
            transfers, size, seconds = self.kv_transfers, self.kv_bytes, self.kv_seconds
            by_peer = {peer: list(row) for peer, row in self.kv_by_peer.items()}
            now = time.monotonic()
            self.waiting_until = {h: t for h, t in self.waiting_until.items() if t > now}
            running, waiting = self.running, len(self.waiting_until)
        self.pool.sweep()
        usage = 1.0 - self.pool.free_bytes / self.pool.capacity_bytes if self.pool.capacity_bytes else 0.0
        role = self.cfg.role
        lines = [
            "# HELP matrix_reference:num_requests_running Requests this worker is serving now.",
            "# TYPE matrix_reference:num_requests_running gauge",
            f'matrix_reference:num_requests_running{{role="{role}"}} {running}',
            "# HELP matrix_reference:num_requests_waiting Decodes waiting for KV that has not arrived.",
            "# TYPE matrix_reference:num_requests_waiting gauge",
            f'matrix_reference:num_requests_waiting{{role="{role}"}} {waiting}',
            "# HELP matrix_reference:kv_cache_usage_perc Fraction of the KV pool in use (1 = full).",
            "# TYPE matrix_reference:kv_cache_usage_perc gauge",
            f'matrix_reference:kv_cache_usage_perc{{role="{role}"}} {usage!r}',
            "# HELP matrix_reference:kv_transfers_total KV transfers decode pulled over the side channel.",
            "# TYPE matrix_reference:kv_transfers_total counter",
            f'matrix_reference:kv_transfers_total{{role="{self.cfg.role}"}} {transfers}',
            "# HELP matrix_reference:kv_transfer_bytes_total Bytes of KV cache decode pulled.",
            "# TYPE matrix_reference:kv_transfer_bytes_total counter",
            f'matrix_reference:kv_transfer_bytes_total{{role="{self.cfg.role}"}} {size}',
            "# HELP matrix_reference:kv_transfer_seconds_total Seconds decode spent pulling KV cache.",
            "# TYPE matrix_reference:kv_transfer_seconds_total counter",
            f'matrix_reference:kv_transfer_seconds_total{{role="{self.cfg.role}"}} {seconds!r}',
            # Its own names, so the totals above (which a ledger sums over labels) are not counted twice.
            "# HELP matrix_reference:kv_pair_transfers_total KV transfers decode pulled, per prefill worker.",
            "# TYPE matrix_reference:kv_pair_transfers_total counter",
            *(f'matrix_reference:kv_pair_transfers_total{{prefill_worker_id="{peer}"}} {int(row[0])}'
              for peer, row in sorted(by_peer.items())),
            "# HELP matrix_reference:kv_pair_transfer_bytes_total Bytes of KV decode pulled, per prefill worker.",
            "# TYPE matrix_reference:kv_pair_transfer_bytes_total counter",
            *(f'matrix_reference:kv_pair_transfer_bytes_total{{prefill_worker_id="{peer}"}} {int(row[1])}'
              for peer, row in sorted(by_peer.items())),
        ]  # fmt: skip
        req.send_bytes(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4; charset=utf-8")

    def prefill(self, req: JSONHandler) -> None:
        body = req.read_json_object()
        request_id = body.get("request_id")
        prompt = body.get("prompt")
        if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_HANDLE_BYTES // 4:
            raise HTTPError(400, "request_id must be a non-empty string of at most 256 characters")
        if not isinstance(prompt, str):
            raise HTTPError(400, "prompt must be a string")
        ids = tokens.tokenize(prompt)
        if not ids:
            raise HTTPError(400, "prompt has no tokens")
        bb = self.cfg.block_bytes
        blocks = [tokens.block_content(tok, pos, bb) for pos, tok in enumerate(ids)]
        try:
            digest = self.pool.put(request_id, blocks)
        except PoolFullError as exc:
            self.log(f"prefill request_id={request_id} rejected: {exc}")
            raise HTTPError(400, str(exc)) from exc
        except DuplicateHandleError as exc:
            raise HTTPError(409, str(exc)) from exc
        first_token = tokens.generate(blocks[-1], 1)[0]
        self.log(f"prefill request_id={request_id} prompt_tokens={len(ids)} blocks={len(blocks)}")
        req.send_json(
            200,
            {
                "request_id": request_id,
                "prompt_tokens": len(ids),
                "first_token": first_token,
                "kv": {
                    "host": "127.0.0.1",
                    "port": self.cfg.side_channel_port,
                    "handle": request_id,
                    "num_blocks": len(blocks),
                    "checksum": digest,
                    # Who made the blocks: decode counts its transfers per prefill peer (an xPyD ledger).
                    "prefill_worker_id": self.instance_id,
                },
                "prefill_worker_id": self.instance_id,
            },
        )

    def decode(self, req: JSONHandler) -> None:
        with self._kv_lock:
            self.running += 1
        try:
            self._decode(req)
        finally:
            with self._kv_lock:
                self.running -= 1

    def _decode(self, req: JSONHandler) -> None:
        body = req.read_json_object()
        kv = body.get("kv")
        max_tokens = body.get("max_tokens")
        if not isinstance(kv, dict):
            raise HTTPError(400, "kv must be the object returned by /prefill")
        host, port, handle = kv.get("host"), kv.get("port"), kv.get("handle")
        num_blocks, expected = kv.get("num_blocks"), kv.get("checksum")
        if not (
            isinstance(host, str)
            and _is_int(port)
            and isinstance(handle, str)
            and _is_int(num_blocks)
            and isinstance(expected, str)
        ):
            raise HTTPError(400, "kv needs host (str), port (int), handle (str), num_blocks (int), checksum (str)")
        if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise HTTPError(400, f"max_tokens must be an integer from 1 to {MAX_TOKENS_LIMIT}")
        bb = self.cfg.block_bytes
        if self.cfg.role == "aggregated":
            local = handle  # prefill wrote the blocks into this worker's own pool: nothing moves
            if self.pool.get(local) is None:
                raise HTTPError(400, f"no KV blocks under handle {handle!r} in this aggregated worker")
        else:
            needed = num_blocks * bb
            if needed > self.pool.free_bytes:
                # Checked before pulling, so a full decode cache leaves the blocks on prefill (TTL frees them).
                raise HTTPError(400, str(PoolFullError(needed, self.pool.free_bytes, self.pool.capacity_bytes)))
            try:
                data = self._pull(host, port, handle, num_blocks, expected, str(kv.get("prefill_worker_id", "")))
            except HTTPError:
                if "hold-orphan-decode" in self.cfg.faults:
                    self._hold_orphan(handle, num_blocks)
                raise
            if "kv-corrupt-after-checksum" in self.cfg.faults:
                data = _corrupt_last_block(data, bb)
                self.log(f"decode handle={handle} corrupted the last KV block after its checksum passed (fault)")
            local = f"decode:{handle}"
            try:
                self.pool.put(local, [data[i : i + bb] for i in range(0, len(data), bb)])
            except (PoolFullError, DuplicateHandleError) as exc:
                raise HTTPError(400, str(exc)) from exc
        stream = body.get("stream", False) is True
        try:
            # Generation reads the cache back from the pool, so the pool's memory is really used.
            cached = self._under_load(handle, self.pool.get(local) or b"")
            count = 1 if "one-token-completion" in self.cfg.faults else max_tokens
            top = tokens.top_logprobs(cached[-bb:], count)
            ids = [best[0] for best, _ in top]
            if stream:
                self._stream_tokens(req, handle, ids, [[list(best), list(runner_up)] for best, runner_up in top])
                return
            if self.cfg.token_delay_s:
                time.sleep(self.cfg.token_delay_s * len(ids))  # the blocks stay held, as in a real decode
        except (BrokenPipeError, ConnectionResetError):
            if "leak-on-cancel" in self.cfg.faults:
                self.log(f"decode handle={handle} client went away; KV blocks kept (fault leak-on-cancel)")
                local = ""
            raise
        finally:
            if local:
                self.pool.free(local)
        self.log(f"decode handle={handle} blocks={num_blocks} completion_tokens={len(ids)}")
        req.send_json(
            200,
            {
                "text": tokens.detokenize(ids),
                "completion_tokens": len(ids),
                "token_ids": ids,
                "top_logprobs": [[list(best), list(runner_up)] for best, runner_up in top],
                "finish_reason": "length",
                "decode_worker_id": self.instance_id,
            },
        )

    def _under_load(self, handle: str, cached: bytes) -> bytes:
        """The faults that only concurrency shows (`matrix.reference.concurrency`): each acts only while
        another decode is in flight, so one request at a time (the primary request, the oracle) never sees it."""
        return self.concurrency.apply(handle, cached, self.running_now())

    def running_now(self) -> int:
        with self._kv_lock:
            return self.running

    def _stream_tokens(
        self, req: JSONHandler, handle: str, ids: list[int], tops: list[list[list[float]]] | None = None
    ) -> None:
        """One JSON line per token, paced like a real decode step (at least `STREAM_TOKEN_S`), the blocks
        held until the last; a client that goes away ends it at the next write (BrokenPipe)."""
        req.send_response(200)
        req.send_header("Content-Type", "application/x-ndjson")
        req.end_headers()
        for i, tok in enumerate(ids):
            time.sleep(max(self.cfg.token_delay_s, STREAM_TOKEN_S))
            top = tops[i] if tops and i < len(tops) else None
            line = {"token_id": tok, "text": tokens.detokenize_one(tok), "top": top}
            req.wfile.write(json.dumps(line).encode() + b"\n")
            req.wfile.flush()
        end = {"done": True, "completion_tokens": len(ids), "finish_reason": "length",
               "decode_worker_id": self.instance_id}  # fmt: skip
        req.wfile.write(json.dumps(end).encode() + b"\n")
        req.wfile.flush()
        self.log(f"decode handle={handle} streamed completion_tokens={len(ids)}")

    def _hold_orphan(self, handle: str, num_blocks: int) -> None:
        """Fault hold-orphan-decode: a decode whose KV never came keeps its slot (and reserved blocks) for
        the KV TTL, as an engine that waits out its own timeout instead of releasing the request."""
        with self._kv_lock:
            self.waiting_until[handle] = time.monotonic() + self.cfg.kv_ttl_s
        with contextlib.suppress(PoolFullError, DuplicateHandleError, ValueError):
            self.pool.put(f"orphan:{handle}", [bytes(self.cfg.block_bytes)] * max(1, num_blocks))
        self.log(f"decode handle={handle} holds its slot for {self.cfg.kv_ttl_s:g}s (fault hold-orphan-decode)")

    def _pull(self, host: str, port: int, handle: str, num_blocks: int, expected: str, peer: str = "") -> bytes:
        """Pull the blocks over the side channel and verify them; any failure is a 502."""
        if "kv-handshake-refusal" in self.cfg.faults:
            self._refuse_in_handshake(handle)
        began = time.perf_counter()
        # Said before the pull, so a pull that never returns leaves its last line naming what decode waits on.
        self.log(f"decode handle={handle} pulling {num_blocks} blocks from side channel {host}:{port}")
        try:
            # kv-transfer-stall: decode waits for the KV as long as it takes, as an engine without a KV timeout.
            timeout_s = None if "kv-transfer-stall" in self.cfg.faults else 30.0
            got_blocks, block_bytes, data = pull_blocks(host, port, handle, timeout_s)
            if block_bytes != self.cfg.block_bytes:
                raise KVTransferError(f"block size {block_bytes} differs from decode's {self.cfg.block_bytes}")
            if got_blocks != num_blocks:
                raise KVTransferError(f"expected {num_blocks} blocks, received {got_blocks}")
            actual = checksum(data)
            if actual != expected:
                raise KVTransferError(f"checksum mismatch: expected {expected}, received {actual}")
        except KVTransferError as exc:
            self.log(f"error: decode handle={handle} KV transfer failed: {exc}")
            raise HTTPError(502, f"KV transfer failed: {exc}", "kv_transfer_error") from exc
        with self._kv_lock:
            self.kv_transfers += 1
            self.kv_bytes += len(data)
            self.kv_seconds += time.perf_counter() - began
            row = self.kv_by_peer.setdefault(peer or f"{host}:{port}", [0, 0])
            row[0] += 1
            row[1] += len(data)
        return data


    def _refuse_in_handshake(self, handle: str) -> None:
        """Fault kv-handshake-refusal: the transfer set-up rejects the peer before any token, as vLLM's decode
        does for prefill blocks it cannot split; the traceback goes to the log line by line under one header."""
        try:
            add_remote_agent(local_block_tokens=32, remote_block_tokens=64)
        except AssertionError as exc:
            self.log(f"error: decode handle={handle} NIXL transfer failure: handshake_setup_failed")
            for line in traceback.format_exc().splitlines():
                self.log(f"error: {line}")
            raise HTTPError(500, "Internal Server Error", "internal_error") from exc


def add_remote_agent(local_block_tokens: int, remote_block_tokens: int) -> None:
    """The handshake's check of the peer's KV layout (named as vLLM's NIXL connector names it)."""
    if local_block_tokens % remote_block_tokens:  # raised, not asserted: `python -O` keeps the check
        raise AssertionError(f"Local block size {local_block_tokens} is not divisible by remote block size "
                             f"{remote_block_tokens} or vice versa.")  # fmt: skip


def _corrupt_last_block(data: bytes, block_bytes: int) -> bytes:
    """Fault kv-corrupt-after-checksum: the last block's bytes inverted, as a stale or misplaced block would
    be; the transfer's checksum was already verified, so only the tokens can tell."""
    return data[:-block_bytes] + bytes(b ^ 0xFF for b in data[-block_bytes:])


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _spawn_escaped_child(log: EventLog) -> None:
    """Fault escaped-child: a sleeper in its own session, as MPI launchers leave behind.

    Like a real leaked child it keeps the worker's environment (so MATRIX_CELL_ID identifies it) and
    its stdout/stderr, so a supervisor that reads the worker's pipes until EOF would wait forever.
    """
    import subprocess  # only this fault needs it

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(10**6)"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    _ESCAPED.append(child)
    log(f"spawned escaped child pid={child.pid} in a new session (fault escaped-child)")


def _write_hostile() -> None:
    """Fault hostile-output: the raw lines, straight to stdout (the supervisor's pipe), NUL and all."""
    from matrix.reference.hostile import LOG_LINES, echoed_values

    for line in [*LOG_LINES, *echoed_values(os.environ)]:
        sys.stdout.buffer.write(line.encode("utf-8", errors="surrogatepass") + b"\n")
    sys.stdout.buffer.flush()


_EXPOSED: list[socket.socket] = []


def _listen_everywhere(log: EventLog) -> None:
    """Fault listen-everywhere: a socket on every interface, kept open (and unused) until the worker exits."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))  # the fault is exactly this exposure
    sock.listen(1)
    _EXPOSED.append(sock)
    log(f"listening on 0.0.0.0:{sock.getsockname()[1]} (fault listen-everywhere)")


def _first_start() -> bool:
    """True the first time for the state file named by $MATRIX_REFERENCE_STATE (which this creates)."""
    state = os.environ.get(STATE_ENV)
    if not state:
        return True
    try:
        with open(state, "x"):
            return True
    except FileExistsError:
        return False


def _load_kernels(cfg: WorkerConfig, log: EventLog) -> None:
    """Stand-in for an engine's compiled kernels: built once into the cache directory that XDG_CACHE_HOME
    names (as engines do under ~/.cache), found there by later starts. No cache directory, no cache."""
    cache_home = os.environ.get("XDG_CACHE_HOME")
    if not cache_home:
        return
    path = Path(cache_home) / "matrix-reference" / f"kernels-{cfg.role}-{cfg.device}-{cfg.kv_cache_bytes}.bin"
    blob = hashlib.sha256(f"{cfg.role}:{cfg.device}:{cfg.kv_cache_bytes}".encode()).digest()
    try:
        if path.read_bytes() == blob:
            log(f"kernel cache hit: {path}")
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent cells: rename is atomic
    partial.write_bytes(blob)
    os.replace(partial, path)
    log(f"kernel cache miss: built {path}")


def run_worker(cfg: WorkerConfig) -> int:
    """Start the worker and serve until stopped; returns the exit code."""
    log = EventLog(cfg.role)
    faults = cfg.faults & {"prefill": PREFILL_FAULTS, "decode": DECODE_FAULTS}.get(cfg.role, AGGREGATED_FAULTS)
    cfg = WorkerConfig(**{**cfg.__dict__, "faults": faults})
    stop = StopSignal(ignore_sigterm="ignore-sigterm" in faults)
    # The devices it was pinned to, as an engine would see them: lets a run prove its GPU placement.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    log(f"starting role={cfg.role} device={cfg.device} CUDA_VISIBLE_DEVICES={visible} "
        f"faults={','.join(sorted(faults)) or '-'}")  # fmt: skip
    if "ignore-sigterm" in faults:
        log("ignoring SIGTERM (fault ignore-sigterm)")
    if "hostile-output" in faults:
        _write_hostile()
    if "listen-everywhere" in faults:
        _listen_everywhere(log)
    if "crash-at-start" in faults:
        log("error: engine core failed to start: simulated crash (fault crash-at-start)")
        return 1
    if "unmet-dependency" in faults:
        # The line vLLM 0.33.0's `check_nixl_version` raises with, as an engine's traceback ends.
        log("RuntimeError: NIXL >= 1.5.0 is required, but nixl==1.4.1 is installed")
        return 1
    if "flaky-start" in faults and _flake():
        log("error: engine core failed to start: simulated crash (fault flaky-start)")
        return 1
    if "crash-once" in faults and _first_start():
        log("error: engine core failed to start: simulated crash, first start only (fault crash-once)")
        return 1
    if "hang-at-start" in faults:
        log("hanging before listening (fault hang-at-start)")
        stop.wait()
        log(f"received {stop.name} while hanging, exiting")
        return 0
    if "slow-start" in faults:
        log(f"waiting {cfg.slow_start_s:g}s before listening (fault slow-start)")
        if stop.wait(cfg.slow_start_s):
            log(f"received {stop.name} during slow start, exiting")
            return 0

    _load_kernels(cfg, log)
    try:
        storage = make_storage(cfg.device, cfg.kv_cache_bytes)
    except DeviceUnavailableError as exc:
        log(f"error: {exc}")
        return 2
    # Fault dead-peer-kv-held: KV no decode took is never expired, so a dead decode's share stays for good.
    ttl_s = math.inf if "dead-peer-kv-held" in cfg.faults else cfg.kv_ttl_s
    pool = KVPool(storage, cfg.kv_cache_bytes, cfg.block_bytes, ttl_s, log)
    instance_id = secrets.randbits(64)
    app = WorkerApp(cfg, pool, instance_id, log)
    try:
        http_server = AppServer(cfg.port, app, log)
    except OSError as exc:
        log(f"error: cannot listen on 127.0.0.1:{cfg.port}: {exc}")
        pool.close()
        return 1
    try:
        side = SideChannelServer(
            cfg.side_channel_port, pool, log, "kv-transfer-dropped" in faults, "kv-transfer-stall" in faults,
            keep_after_pull="kv-read-report-lost" in faults,
        )  # fmt: skip
    except OSError as exc:
        log(f"error: cannot listen on side channel 127.0.0.1:{cfg.side_channel_port}: {exc}")
        http_server.server_close()
        pool.close()
        return 1
    if "escaped-child" in faults:
        _spawn_escaped_child(log)
    log(
        f"ready role={cfg.role} http=127.0.0.1:{cfg.port} side_channel=127.0.0.1:{cfg.side_channel_port} "
        f"instance_id={instance_id} kv_blocks={pool.num_blocks} block_bytes={cfg.block_bytes}"
    )
    try:
        serve_until_stopped([http_server, side], stop, log)
    finally:
        pool.close()
    log("stopped, KV pool freed")
    return 0


def _flake() -> bool:
    """True with probability $MATRIX_REFERENCE_FLAKE_RATE (default 1: always), from the OS's randomness."""
    try:
        rate = float(os.environ.get(FLAKE_RATE_ENV, "1"))
    except ValueError:
        rate = 1.0
    return secrets.randbelow(1_000_000) < rate * 1_000_000
