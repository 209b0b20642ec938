"""Checks on what an engine holds once a request is over: `kv_released_after_answer`, `cancel_recovers` and
`orphan_decode_released`. All judge from the engines' own scheduler gauges (Prometheus: requests running,
requests waiting, KV-cache usage), read before the request, while it is in flight, and after it ended or was
dropped; the readings are kept as evidence in the cell's log directory (`kv_released_after_answer.json`,
`cancel_recovers.json`, `orphan_decode_released.json`).

`kv_released_after_answer`: once the primary request and its streaming twin were answered, every engine
must be at rest within `rest_bound_s`: nothing running or waiting, and KV usage no higher than before the
primary request (zero on a pair of its own; engines a skew grid shares keep what an earlier cell left, such
as a refused pair's blocks waiting for their lease, and should that expire meanwhile it can hide this cell's
own: a limit of shared engines). A NIXL prefill frees a request's blocks when decode reports that it read
them; a lost report leaves them held until the prefill's own lease runs out (vLLM: 30 s), with every answer
right. The bound is well below that lease and far above a healthy release (under a second on a loaded
2-core host).

`cancel_recovers`: a streaming request with many tokens and ``ignore_eos`` is read for a few chunks, then
its connection is dropped. Within the bound every engine (prefill and decode) must report nothing running
or waiting and its KV usage back at its level before the request; then the primary request is sent again
and must fail no check the first one did not (the engine answers correctly after a cancel). A stream that no
engine's gauges showed in flight when it was dropped, or that ended whole first (the engine had already
generated all of it) proves nothing: another is opened and dropped at its first chunk, up to
`CANCEL_ATTEMPTS`, and if none is caught the check is skipped, saying so (`streams` in the evidence tells
each attempt).

`orphan_decode_released`: a decode request whose KV is said to wait on a prefill engine that does not
exist (vLLM's `kv_transfer_params` naming a side channel nothing listens on), so the KV never arrives.
It is read for a moment (the engine may fail or recompute it by itself), then dropped; within the bound
the decode engine must have freed it, instead of holding the slot for its own KV timeout (300 s).
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from matrix.check.client import build_payload, send_chat
from matrix.check.http import loopback_client
from matrix.check.specs import CheckFailure, EngineGauges, LifecycleSpec, RequestSpec
from matrix.check.streaming import stream_check
from matrix.check.validate import validate_chat_response
from matrix.text import excerpt

RELEASED = "kv_released_after_answer"
CANCEL = "cancel_recovers"
ORPHAN = "orphan_decode_released"
POLL_S = 0.25
# Checks of the primary request that say how it was served, not whether: an aggregated twin fails the
# first by design, a recompute control the second. Any other failure skips the cancel and orphan checks.
TOPOLOGY_CHECKS = frozenset({"worker_ids_distinct", "kv_transfer"})
# KV usage is a fraction of the cache (vLLM: 0..1); below this it is the same level.
KV_TOLERANCE = 1e-6
# How long the orphaned decode is left waiting before it is dropped (the engine may end it by itself).
ORPHAN_HOLD_S = 5.0
# Streams opened until one is caught in flight: one that an engine finished before the drop proved nothing.
# Five, because on a loaded 2-core host a fast engine (vllm-rs behind Dynamo's frontend) finished three in a
# row before the client had read three chunks (CI); after a miss the stream is dropped at its first chunk.
CANCEL_ATTEMPTS = 5

Reading = dict[str, float] | str


def parse_gauges(text: str, engine: EngineGauges) -> Reading:
    """running, waiting and kv_usage of one engine (summed over label sets), or why they cannot be read.

    A gauge the engine does not publish is an error, never a silent 0: a renamed metric would otherwise
    read as an idle engine and pass every time.
    """
    wanted = {"running": engine.running, "waiting": engine.waiting, "kv_usage": engine.kv_usage}
    values = dict.fromkeys(wanted, 0.0)
    wanted = {key: metric for key, metric in wanted.items() if metric}  # a gauge named "" is not published
    seen: set[str] = set()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.partition(" ") if "}" not in line else line.partition("} ")
        name = head.partition("{")[0].strip()
        for key, metric in wanted.items():
            if name == metric:
                fields = rest.split()
                try:
                    value = float(fields[0]) if fields else math.nan
                except ValueError:
                    continue
                if not math.isnan(value):
                    values[key] += value
                    seen.add(key)
    missing = [wanted[key] for key in wanted if key not in seen]
    if missing:
        return f"{engine.url} publishes no {', '.join(missing)}"
    return values


def read_gauges(engines: tuple[EngineGauges, ...], client: httpx.Client) -> dict[str, Reading]:
    readings: dict[str, Reading] = {}
    for engine in engines:
        try:
            response = client.get(engine.url)
            response.raise_for_status()
            readings[engine.role] = parse_gauges(response.text, engine)
        except httpx.HTTPError as exc:
            readings[engine.role] = f"cannot read {engine.url}: {exc}"
    return readings


def released(before: dict[str, Reading], now: dict[str, Reading]) -> list[str]:
    """What still holds work, per engine ("" entries are none): empty when every engine is back."""
    held = []
    for role, reading in now.items():
        old = before.get(role)
        if isinstance(reading, str) or isinstance(old, str) or old is None:
            held.append(f"{role}: {reading if isinstance(reading, str) else old}")
            continue
        parts = []
        if reading["running"] > 0:
            parts.append(f"{reading['running']:g} running")
        if reading["waiting"] > 0:
            parts.append(f"{reading['waiting']:g} waiting")
        if reading["kv_usage"] > old["kv_usage"] + KV_TOLERANCE:
            parts.append(f"KV usage {reading['kv_usage']:g} (was {old['kv_usage']:g})")
        if parts:
            held.append(f"{role}: {', '.join(parts)}")
    return held


def held_at_rest(now: dict[str, Reading], floor: dict[str, Reading] | None = None) -> list[str]:
    """What still holds work or KV, per engine (empty: all at rest): nothing may run or wait, and KV usage may
    not exceed the engine's `floor` reading (an engine without a readable one: zero, what an idle one reads)."""
    held = []
    for role, reading in now.items():
        if isinstance(reading, str):
            held.append(f"{role}: {reading}")
            continue
        parts = [f"{reading[gauge]:g} {gauge}" for gauge in ("running", "waiting") if reading[gauge] > 0]
        old = (floor or {}).get(role)
        level = old["kv_usage"] if isinstance(old, dict) else 0.0
        if reading["kv_usage"] > level + KV_TOLERANCE:
            was = f" (was {level:g} before the request)" if level else ""
            parts.append(f"KV usage {reading['kv_usage']:g}{was}")
        if parts:
            held.append(f"{role}: {', '.join(parts)}")
    return held


@dataclass
class Evidence:
    """What one check saw, written as JSON beside the cell's logs."""

    check: str
    bound_s: float
    before: dict[str, Reading] = field(default_factory=dict)
    during: dict[str, Reading] = field(default_factory=dict)
    after: dict[str, Reading] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None
    skipped: str | None = None

    def write(self, record_dir: str) -> None:
        passed = None if self.skipped else self.failure is None
        document = {"check": self.check, "bound_s": self.bound_s, "passed": passed, **self.facts,
                    "failure": self.failure, "skipped": self.skipped,
                    "before": self.before, "during": self.during, "after": self.after}  # fmt: skip
        with contextlib.suppress(OSError):  # evidence only: a write error is not a check failure
            (Path(record_dir) / f"{self.check}.json").write_text(json.dumps(document, indent=1) + "\n", "utf-8")


def _wait_released(
    engines: tuple[EngineGauges, ...], client: httpx.Client, evidence: Evidence, started: float
) -> list[str]:
    """Poll the gauges until every engine is back to its level before the request, or the bound passed."""
    deadline = started + evidence.bound_s
    while True:
        evidence.after = read_gauges(engines, client)
        held = released(evidence.before, evidence.after)
        if not held or time.monotonic() >= deadline:
            evidence.facts["released_s" if not held else "still_held_after_s"] = round(time.monotonic() - started, 3)
            return held
        time.sleep(POLL_S)


@dataclass
class _Drop:
    """A stream read until `chunks` data events carried text (or it ended), then dropped by the caller."""

    status_code: int | None = None
    chunks: int = 0
    ended: bool = False
    whole: bool = False  # it ended with [DONE]: the engine answered all of it before the drop
    error: str | None = None
    body_excerpt: str = ""


def gauges_now(engines: tuple[EngineGauges, ...]) -> dict[str, Reading]:
    """Every engine's gauges read once (a reading that failed is its reason, as text)."""
    with loopback_client(5.0) as client:
        return read_gauges(engines, client)


@contextmanager
def _stream_open(
    client: httpx.Client, url: str, payload: dict[str, object], timeout_s: float | httpx.Timeout
) -> Iterator[Any]:
    with client.stream("POST", url, json=payload, timeout=timeout_s,
                       headers={"Accept": "text/event-stream", "Accept-Encoding": "identity"}) as response:  # fmt: skip
        yield response


def _read_chunks(response: Any, lines: Iterator[str], chunks: int, hold_s: float | None) -> _Drop:
    """Read data events until `chunks` carried text, the stream ended, or `hold_s` passed (orphan).

    `lines` is the caller's iterator over the body and must stay referenced until the drop: closing it
    (as a loop over a temporary one does on return) closes the connection, before the gauges are read.
    """
    drop = _Drop(status_code=response.status_code)
    if response.status_code != 200:
        drop.body_excerpt = excerpt(response.read().decode("utf-8", "replace"), 300)
        drop.ended = True
        return drop
    started = time.monotonic()
    for line in lines:
        if line.strip() == "data: [DONE]":
            drop.ended = drop.whole = True
            break
        if line.startswith("data:") and '"content"' in line and '"content": ""' not in line:
            drop.chunks += 1
        if chunks and drop.chunks >= chunks:
            break
        if hold_s is not None and time.monotonic() - started >= hold_s:
            break
    else:
        drop.ended = True
    return drop


def kv_released_after_answer(spec: LifecycleSpec, floor: dict[str, Reading] | None = None) -> list[CheckFailure]:
    """Every engine at rest within `rest_bound_s` of the last answer (see the module docstring); `floor`: the
    gauges before the cell's first request (`before_request` in the evidence)."""
    evidence = Evidence(RELEASED, spec.rest_bound_s)
    if floor is not None:
        evidence.facts["before_request"] = floor
    started = time.monotonic()
    with loopback_client(5.0) as client:
        evidence.before = read_gauges(spec.engines, client)
        while True:
            evidence.after = read_gauges(spec.engines, client)
            held = held_at_rest(evidence.after, floor)
            waited = time.monotonic() - started
            if not held or waited >= spec.rest_bound_s:
                break
            time.sleep(POLL_S)
    evidence.facts["released_s" if not held else "still_held_after_s"] = round(waited, 3)
    if held:
        evidence.failure = (
            f"{spec.rest_bound_s:g} s after the last answer the engines still hold work or KV: {'; '.join(held)} "
            "(the KV of answered requests is not freed)"
        )
    evidence.write(spec.record_dir)
    return [CheckFailure(RELEASED, evidence.failure)] if evidence.failure else []


def cancel_recovers(spec: LifecycleSpec, request: RequestSpec, primary: tuple[CheckFailure, ...]) -> list[CheckFailure]:
    """Drop a stream mid-generation; the engines must free it within the bound, then serve correctly."""
    evidence = Evidence(CANCEL, spec.bound_s)
    started = time.monotonic()
    failure = _cancel(spec, request, primary, evidence)
    evidence.facts["check_s"] = round(time.monotonic() - started, 3)  # what the check adds to the cell
    evidence.failure = failure
    evidence.write(spec.record_dir)
    return [] if failure is None else [CheckFailure(CANCEL, failure)]


def _drop_in_flight(
    spec: LifecycleSpec,
    request: RequestSpec,
    payload: dict[str, object],
    client: httpx.Client,
    evidence: Evidence,
    chunks: int,
) -> tuple[float | None, str | None]:
    """Open the stream, read `chunks` chunks, read the gauges, drop it: (when it was dropped, None) if an
    engine held the request then, (None, None) if every engine had already finished it (the stream may even
    have ended whole), (None, why) on a failure."""
    opened = time.monotonic()
    try:
        with _stream_open(client, request.url, payload, request.timeout_s) as response:
            lines = response.iter_lines()
            drop = _read_chunks(response, lines, chunks, None)
            # Read while the request is still open: the evidence that it was in flight when dropped.
            evidence.during = read_gauges(spec.engines, client)
    except httpx.HTTPError as exc:
        return None, f"the streaming request failed before it could be dropped: {type(exc).__name__}: {exc}"
    dropped = time.monotonic()  # leaving the block above closed the connection mid-body
    evidence.facts |= {"chunks_read": drop.chunks, "stream_ended_before_drop": drop.ended,
                       "max_tokens": spec.cancel_max_tokens}  # fmt: skip
    # Every stream's story, so a check never caught in flight says why each attempt missed.
    story = {"chunks_read": drop.chunks, "ended_whole": drop.whole, "open_s": round(dropped - opened, 3),
             "in_flight_during": _in_flight(evidence.during)}  # fmt: skip
    evidence.facts.setdefault("streams", []).append(story)
    if drop.status_code != 200:
        return None, f"the streaming request answered HTTP {drop.status_code}: {drop.body_excerpt!r}"
    if drop.ended and not drop.whole:
        return None, f"the stream closed after {drop.chunks} chunk(s) without [DONE], before it could be dropped"
    unreadable = [f"{role}: {r}" for role, r in evidence.during.items() if isinstance(r, str)]
    if unreadable:
        return None, f"cannot read the engines' gauges while the request was open: {'; '.join(unreadable)}"
    in_flight = _in_flight(evidence.during)
    evidence.facts["in_flight_during"] = in_flight
    # A stream that ended whole was answered before the drop, whatever the gauges say now: a fast engine
    # whose API server sends what piled up while it waited for the CPU as one chunk (seen on a 2-core host:
    # 384 tokens in 2 chunks) cancels nothing.
    return (dropped if in_flight > 0 and not drop.whole else None), None


def _in_flight(readings: dict[str, Reading]) -> float:
    """Requests running or waiting, summed over the engines whose gauges could be read."""
    return sum(r["running"] + r["waiting"] for r in readings.values() if not isinstance(r, str))


def _cancel(
    spec: LifecycleSpec, request: RequestSpec, primary: tuple[CheckFailure, ...], evidence: Evidence
) -> str | None:
    payload = build_payload(replace(request, max_tokens=spec.cancel_max_tokens), stream=True)
    payload["ignore_eos"] = True  # the answer cannot end on its own before the drop
    with loopback_client(request.timeout_s) as client:
        evidence.before = read_gauges(spec.engines, client)
        unreadable = [f"{role}: {r}" for role, r in evidence.before.items() if isinstance(r, str)]
        if unreadable:
            return f"cannot read the engines' gauges before the request: {'; '.join(unreadable)}"
        for attempt in range(1, CANCEL_ATTEMPTS + 1):
            evidence.facts["attempts"] = attempt
            # After a miss, drop at the first chunk: the engine outran the client reading the later ones.
            chunks = spec.cancel_chunks if attempt == 1 else 1
            dropped, failure = _drop_in_flight(spec, request, payload, client, evidence, chunks)
            if failure is not None:
                return failure
            if dropped is not None:
                break
            # No engine held the request while its stream was open, or the stream ended whole before the drop:
            # the engine had generated the whole answer first (on a loaded machine the client can be held back
            # for the seconds that takes), so the drop cancelled nothing. Once the engines are idle, try again.
            held = _wait_released(spec.engines, client, evidence, time.monotonic())
            if held:
                return f"{spec.bound_s:g} s after a finished answer the engines still hold work: {'; '.join(held)}"
        else:
            # Not a failure of the engine, and no pass either: the check was not exercised, and says so (an
            # engine or frontend that answers whole before streaming, such as the reference one with some
            # faults, always reads so).
            evidence.skipped = (f"in {CANCEL_ATTEMPTS} attempts no engine's gauges showed the request while its "
                                "stream was open (or the stream ended whole before the drop): a drop would cancel "
                                "nothing (raise cancel_max_tokens)")  # fmt: skip
            return None
        held = _wait_released(spec.engines, client, evidence, dropped)
    if held:
        return (f"{spec.bound_s:g} s after the client dropped the stream the engines still hold it: "
                f"{'; '.join(held)}")  # fmt: skip
    recovery = send_chat(request)
    validation = validate_chat_response(recovery.status_code, recovery.body) if recovery.error is None else None
    known = {f.name for f in primary}
    if validation is None:
        evidence.facts["recovery"] = recovery.error
        return f"the request after the cancel failed ({recovery.error_kind}): {recovery.error}"
    new = [f for f in validation.failures if f.name not in known]
    evidence.facts["recovery"] = {"status_code": recovery.status_code, "request_s": round(recovery.request_s, 3),
                                  "failed_checks": [f.name for f in validation.failures],
                                  "completion_tokens": validation.completion_tokens}  # fmt: skip
    if new:
        details = "; ".join(f"{f.name}: {f.message}" for f in new)
        return f"the request after the cancel fails checks the first request passed: {details}"
    return None


@contextmanager
def _dead_port() -> Iterator[int]:
    """A loopback port bound but not listening for as long as the check runs: a prefill that is gone."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


def orphan_payload(request: RequestSpec, dead_port: int, protocol: str = "vllm") -> dict[str, object]:
    """A decode-only request whose KV is promised by a prefill engine that does not exist."""
    if protocol == "reference":
        handle = f"matrix-orphan-{uuid.uuid4().hex[:12]}"
        kv = {"host": "127.0.0.1", "port": dead_port, "handle": handle, "num_blocks": 4, "checksum": "0" * 64}
        return {"request_id": handle, "kv": kv, "max_tokens": 16, "stream": True}
    payload = build_payload(replace(request, max_tokens=16), stream=True)
    payload.pop("nvext", None)
    payload["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": f"matrix-orphan-{uuid.uuid4().hex[:12]}",
        "remote_block_ids": [0],
        "remote_host": "127.0.0.1",
        "remote_port": dead_port,
        "remote_request_id": f"matrix-orphan-{uuid.uuid4().hex[:12]}",
        "tp_size": 1,
    }
    return payload


def orphan_decode_released(spec: LifecycleSpec, request: RequestSpec) -> list[CheckFailure]:
    """Start a decode for KV that never comes; once dropped, decode must free it within the bound."""
    evidence = Evidence(ORPHAN, spec.bound_s)
    if spec.orphan_url is None:
        evidence.skipped = spec.orphan_skip or "this deployment exposes no decode endpoint"
        evidence.write(spec.record_dir)
        return []
    decode = tuple(e for e in spec.engines if e.role == "decode")
    started = time.monotonic()
    failure = _orphan(spec, spec.orphan_url, request, decode, evidence)
    evidence.facts["check_s"] = round(time.monotonic() - started, 3)
    evidence.failure = failure
    evidence.write(spec.record_dir)
    return [] if failure is None else [CheckFailure(ORPHAN, failure)]


def _orphan(
    spec: LifecycleSpec, url: str, request: RequestSpec, decode: tuple[EngineGauges, ...], evidence: Evidence
) -> str | None:
    if not decode:
        return "no decode engine gauges to judge the orphaned decode by"
    with _dead_port() as port, loopback_client(request.timeout_s) as client:
        payload = orphan_payload(request, port, spec.orphan_protocol)
        evidence.facts["request"] = payload
        evidence.before = read_gauges(decode, client)
        unreadable = [f"{role}: {r}" for role, r in evidence.before.items() if isinstance(r, str)]
        if unreadable:
            return f"cannot read decode's gauges before the request: {'; '.join(unreadable)}"
        started = time.monotonic()
        # A decode waiting for KV may send nothing at all: reading is limited to the hold (a read timeout
        # then closes the connection, which is the drop), and the gauges are read on the side just before.
        during = threading.Timer(ORPHAN_HOLD_S * 0.8, lambda: evidence.during.update(gauges_now(decode)))
        during.start()
        drop = _Drop()
        try:
            timeout = httpx.Timeout(request.timeout_s, read=ORPHAN_HOLD_S)
            with _stream_open(client, url, payload, timeout) as response:
                drop = _read_chunks(response, response.iter_lines(), 0, ORPHAN_HOLD_S)
        except httpx.TimeoutException:
            drop.error = f"no byte for {ORPHAN_HOLD_S:g} s: the decode waited silently; dropped"
        except httpx.HTTPError as exc:
            during.cancel()
            return f"the orphaned decode request failed: {type(exc).__name__}: {exc}"
        dropped = time.monotonic()
        if drop.ended:  # the engine ended it by itself (an error or a recomputed answer): read them now
            during.cancel()
            during.join()
            evidence.during = read_gauges(decode, client)
        else:
            during.join()
        evidence.facts |= {"status_code": drop.status_code, "chunks_read": drop.chunks,
                           "ended_by_engine": drop.ended, "held_s_before_drop": round(dropped - started, 3),
                           "answer_excerpt": drop.body_excerpt, "error": drop.error}  # fmt: skip
        held = _wait_released(decode, client, evidence, dropped)
    if held:
        return (f"{spec.bound_s:g} s after the orphaned decode was dropped, decode still holds it: "
                f"{'; '.join(held)}")  # fmt: skip
    return None


def run_lifecycle(
    spec: LifecycleSpec,
    request: RequestSpec,
    primary: tuple[CheckFailure, ...],
    floor: dict[str, Reading] | None = None,
) -> tuple[list[CheckFailure], float | None]:
    """After the primary request: the streaming twin, then `kv_released_after_answer`, `cancel_recovers` (from
    engines at rest), then `orphan_decode_released` (last, as it hands an engine a request meant to go wrong).
    `floor`: the engines' gauges before the primary request (see `kv_released_after_answer`). Returns the
    failures and the stream's TTFT."""
    failures: list[CheckFailure] = []
    ttft_s = None
    if spec.stream:
        result = stream_check(request, Path(spec.record_dir))
        failures += result.failures
        ttft_s = result.ttft_s
    unserved = [f.name for f in primary if f.name not in TOPOLOGY_CHECKS]
    if unserved:
        # An engine that could not serve the first request has nothing to recover to: judging its cancel
        # would blame these checks on a failure the primary request already names.
        reason = f"the primary request failed {', '.join(dict.fromkeys(unserved))}: nothing to recover to"
        for name in (RELEASED, CANCEL, ORPHAN):
            bound = spec.rest_bound_s if name == RELEASED else spec.bound_s
            Evidence(name, bound, skipped=reason).write(spec.record_dir)
        return failures, ttft_s
    if spec.engines:
        failures += kv_released_after_answer(spec, floor)
        failures += cancel_recovers(spec, request, primary)
    if spec.engines or spec.orphan_skip:
        failures += orphan_decode_released(spec, request)
    return failures, ttft_s
