"""The peer-loss check ([M27]): a worker killed under load must not turn into a hang, and must rejoin.

How P/D fails when a peer dies is rarely an error: requests hang at 0 % load (sglang #29482), a survivor holds
KV for the dead peer for good (smg #2464), a stream is cut and handed over as if whole. So for each role of
the spec in turn, the role's first worker is the victim:

1. `streams` streaming requests are opened and read until each has its first token, or one is halfway through
   its answer (in flight), then the victim's process group is killed (SIGKILL). Halfway, because a stream that
   is slow to start (its KV still being read) must not let the others finish first: on a fast host a whole
   answer took less time than one late first token. The kill must prove it took effect (the pid reaped), and
   at least one stream must still have been in flight at it: otherwise the check was not exercised, which
   fails the cell (`peer_loss_not_exercised`), never passes it. So does a stream that ended with an error
   before the kill: the deployment did not serve the load while whole.
2. Every stream must end within `bound_s` of the kill, served whole or with an error: one still open is a hang
   (`peer_loss_hang`, with who waited on what); one that ended as if complete, with fewer tokens than it
   asked for and no error, is a truncated answer served as whole (`peer_loss_truncated`).
3. While the victim is down, new requests (one per worker of its role) must each end within `bound_s`
   (`peer_loss_hang` again); with no other worker of the role left this is the fail-fast rule. Whether they
   were served by a survivor or refused is recorded (routing around a dead worker is a router's policy; a
   200 with no worker of a role is a decode-only fallback, recorded as such).
4. The survivors must release what they held for the dead peer (requests running or waiting, KV above its
   level before the streams, read once they held nothing) within `release_timeout_s`, the engine's own timeout
   for KV nobody takes (`peer_loss_kv_released`); the time it took is recorded.
5. The victim is started again: it must be ready within `rejoin_timeout_s` and serve a request under its new
   instance id within a few turns of the router, and then the deployment must be whole again (a run of
   requests in a row served) within `rejoin_timeout_s` of the restart (`peer_loss_rejoin`).

Everything seen goes to `peer_loss.json` in the cell's log directory: pids, exit codes, each stream's end,
the probes, the gauges and the times.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from matrix.check.client import build_payload, send_chat
from matrix.check.http import loopback_client
from matrix.check.lifecycle import Reading, read_gauges, released
from matrix.check.specs import CheckFailure, EngineGauges, PeerLossSpec, RequestSpec
from matrix.check.topology import instance_id
from matrix.check.validate import validate_chat_response
from matrix.text import excerpt

NOT_EXERCISED = "peer_loss_not_exercised"
HANG = "peer_loss_hang"
TRUNCATED = "peer_loss_truncated"
KV_RELEASED = "peer_loss_kv_released"
REJOIN = "peer_loss_rejoin"
CHECK_NAMES = (NOT_EXERCISED, HANG, TRUNCATED, KV_RELEASED, REJOIN)
POLL_S = 0.1
# Requests sent after the restart, per worker of the role, until the new instance serves one.
REJOIN_TURNS = 4
# How long a SIGKILLed worker may take to be reaped. The kernel frees a large engine's memory before the exit
# can be reaped, which took over 5 s for a vLLM CPU worker on a loaded 2-core host; the time is recorded.
REAP_TIMEOUT_S = 60.0


class Peers(Protocol):
    """What the check needs of the cell's processes (the supervisor has it)."""

    def kill_role(self, role: str, reap_timeout_s: float) -> tuple[int, int | None, str]: ...

    def restart_role(self, role: str) -> int: ...

    def wait_role_ready(self, role: str, timeout_s: float) -> str | None: ...


# Who waited on what, for a hang's message: (the request that hung, seconds it waited) -> text.
WaitedOn = Callable[[RequestSpec, float], str]


@dataclass
class StreamEnd:
    """How one stream ended: "served" (whole), "error", "truncated" or "hang" (still open at the bound);
    `before_kill` when it ended before the kill (it was not in flight, so it proves nothing)."""

    outcome: str = "hang"
    before_kill: bool = False
    status_code: int | None = None
    tokens: int = 0
    chunks: int = 0  # events with text: fewer than `tokens` where the server sent several tokens in one
    finish_reason: str | None = None
    error: str | None = None
    first_token_s: float | None = None
    ended_s: float | None = None  # seconds after the kill (before it: after the stream's start)
    # Tokens it had when the kill came: 0 for a stream still waiting for its first (its KV not yet with decode).
    tokens_at_kill: int | None = None


@dataclass
class _Stream:
    request: RequestSpec
    max_tokens: int
    stop: threading.Event
    first: threading.Event = field(default_factory=threading.Event)
    # Set once half of `max_tokens` came, or the stream ended after its first token. Tokens are counted from the
    # usage each chunk carries where the server sends it (`continuous_usage_stats`), else one per text chunk:
    # vLLM's API server sends what piled up while it was busy as one chunk, so on a loaded host counting chunks
    # saw three 1536-token answers end whole before any was "halfway" (CI, 2 cores).
    halfway: threading.Event = field(default_factory=threading.Event)
    end: StreamEnd = field(default_factory=StreamEnd)
    kill_at: list[float] = field(default_factory=list)  # set once the kill happened (monotonic time)

    def run(self, bound_s: float) -> None:
        started = time.monotonic()
        payload = {**build_payload(self.request, stream=True), "max_tokens": self.max_tokens,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
        # The caller names a hang at the bound after the kill; the read itself gives up only after the
        # request's own timeout, so a slow first token before the kill is not cut short.
        timeout = httpx.Timeout(self.request.timeout_s, read=max(bound_s, self.request.timeout_s))
        try:
            with (
                loopback_client(self.request.timeout_s) as client,
                client.stream("POST", self.request.url, json=payload, timeout=timeout) as response,
            ):
                self.end.status_code = response.status_code
                if response.status_code != 200:
                    self.end.outcome, self.end.error = "error", excerpt(response.read().decode(errors="replace"), 300)
                    return
                for line in response.iter_lines():
                    if self.stop.is_set():
                        return  # cut as a hang: the outcome stays "hang"
                    self._see(line, started)
                    if self.end.outcome != "hang":
                        return
                self.end.outcome = "error"
                self.end.error = self.end.error or "the stream closed without [DONE]"
        except httpx.ReadTimeout:
            pass  # silent for the whole read timeout: the outcome stays "hang"
        except httpx.HTTPError as exc:
            self.end.outcome, self.end.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            if self.end.outcome != "hang":
                self.end.before_kill = not self.kill_at
                self.end.ended_s = round(time.monotonic() - (self.kill_at[0] if self.kill_at else started), 3)
            if self.first.is_set():
                self.halfway.set()  # an answer that ended is past its half; an error before it is no sign of one
            self.first.set()  # last: a stream that ended before its first token is not waited for

    def _see(self, line: str, started: float) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            whole = self.end.finish_reason == "stop" or (
                self.end.finish_reason == "length" and self.end.tokens >= self.max_tokens
            )
            if self.end.error is not None:
                self.end.outcome = "error"
            else:
                self.end.outcome = "served" if whole else "truncated"
            return
        try:
            event = json.loads(data)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            self.end.error = excerpt(json.dumps(event["error"]), 300)
            return
        for choice in event.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                self.end.chunks += 1
                self.end.tokens += 1
                if not self.first.is_set():
                    self.end.first_token_s = round(time.monotonic() - started, 3)
                    self.first.set()
            self.end.finish_reason = choice.get("finish_reason") or self.end.finish_reason
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.end.tokens = max(self.end.tokens, usage["completion_tokens"])
        if self.end.tokens >= self.max_tokens // 2:
            self.halfway.set()


@dataclass
class _Round:
    """One victim's kill and restart, as `peer_loss.json` records it."""

    victim: str
    role: str
    pid: int | None = None
    exit_code: int | None = None
    reaped_s: float | None = None  # seconds from the SIGKILL until the pid was reaped
    killed_when: str = ""  # what the kill waited for: every stream's first token, a stream halfway, the bound
    streams: list[dict[str, Any]] = field(default_factory=list)
    down_probes: list[dict[str, Any]] = field(default_factory=list)
    survivors_before: dict[str, Reading] = field(default_factory=dict)
    # Seconds the survivors took to hold nothing (no request, no KV) before the streams; None: they never did
    # within `release_timeout_s`, and their level then is the one they must come back to.
    settled_s: float | None = None
    survivors_after: dict[str, Reading] = field(default_factory=dict)
    # What the survivors still held at the first look after the requests ended (empty: nothing), e.g. a prefill's
    # KV for a request whose decode died, which it keeps until its own timeout.
    survivors_held: list[str] = field(default_factory=list)
    released_s: float | None = None
    new_pid: int | None = None
    new_instance_id: str | None = None
    rejoined_s: float | None = None
    served_after_rejoin: list[dict[str, Any]] = field(default_factory=list)
    # Requests refused after the new instance had served (sent to the dead one's entry), and the seconds from the
    # restart until a run of requests in a row was served (the deployment whole again; see `_whole_again`).
    refused_after_rejoin: list[dict[str, Any]] = field(default_factory=list)
    whole_s: float | None = None
    failures: list[str] = field(default_factory=list)


def judge_peer_loss(spec: PeerLossSpec, request: RequestSpec, peers: Peers, waited_on: WaitedOn) -> list[CheckFailure]:
    """Kill and restart one worker of each role of `spec` in turn (see the module docstring)."""
    failures: list[CheckFailure] = []
    rounds: list[_Round] = []
    for role in spec.roles:
        victims = [w for w in spec.workers if w.role == role]
        if not victims:
            continue
        record = _Round(victims[0].name, role)
        rounds.append(record)
        found = _one_round(spec, request, peers, waited_on, record, len(victims))
        record.failures = [f"{f.name}: {f.message}" for f in found]
        failures += found
        if any(f.name in (NOT_EXERCISED, REJOIN) for f in found):
            break  # the deployment is not whole again: a next round would judge a broken one
    _write(spec, rounds)
    return failures


def _one_round(
    spec: PeerLossSpec, request: RequestSpec, peers: Peers, waited_on: WaitedOn, record: _Round, of_role: int
) -> list[CheckFailure]:
    victim = record.victim
    survivors = tuple(g for g in spec.gauges if g.role != victim)
    record.survivors_before, record.settled_s = _at_rest(survivors, spec.release_timeout_s)
    stop = threading.Event()
    streams = [_Stream(request, spec.stream_tokens, stop) for _ in range(spec.streams)]
    threads = [threading.Thread(target=s.run, args=(spec.bound_s,), name=f"peer-loss-{i}", daemon=True)
               for i, s in enumerate(streams)]  # fmt: skip
    for thread in threads:
        thread.start()
    record.killed_when = _kill_moment(streams, time.monotonic() + spec.bound_s)
    killed = time.monotonic()  # marked first: a stream ending during the kill counts as in flight
    for stream in streams:
        stream.kill_at.append(killed)
        stream.end.tokens_at_kill = stream.end.tokens
    record.pid, record.exit_code, stuck = peers.kill_role(victim, REAP_TIMEOUT_S)
    if record.exit_code is not None:
        record.reaped_s = round(time.monotonic() - killed, 3)
    for thread in threads:
        thread.join(max(0.0, killed + spec.bound_s - time.monotonic()))
    stop.set()
    hung = [s for s in streams if s.end.outcome == "hang"]
    evidence = waited_on(request, spec.bound_s) if hung else ""
    for thread in threads:
        thread.join(timeout=2.0)
    record.streams = [asdict(s.end) for s in streams]
    failures: list[CheckFailure] = []
    if record.exit_code is None:
        gone = f"{victim} (pid {record.pid}) was still not gone {REAP_TIMEOUT_S:g} s after SIGKILL ({stuck})"
        failures.append(CheckFailure(NOT_EXERCISED, gone))
        return failures
    failures += _failed_before_kill(streams, record)
    in_flight = [s for s in streams if not s.end.before_kill]
    if not in_flight:
        failures.append(CheckFailure(NOT_EXERCISED, (
            f"none of the {len(streams)} stream(s) was still in flight when {victim} was killed (each ended first): "
            "ask for longer answers (launch.peer_loss.stream_tokens) or a slower engine")))  # fmt: skip
        return failures
    if hung:
        failures.append(CheckFailure(HANG, (
            f"{len(hung)} of {len(in_flight)} stream(s) in flight when {victim} (pid {record.pid}) was killed had not "
            f"ended {spec.bound_s:g} s later\n--- who waited on what ---\n{evidence}")))  # fmt: skip
    truncated = [s.end for s in in_flight if s.end.outcome == "truncated"]
    if truncated:
        cut = truncated[0]
        failures.append(CheckFailure(TRUNCATED, (
            f"{len(truncated)} stream(s) in flight when {victim} was killed ended as if complete (finish_reason "
            f"{cut.finish_reason!r}, no error) after {cut.tokens} of {spec.stream_tokens} tokens")))  # fmt: skip
    failures += _while_down(spec, request, record, of_role, waited_on)
    failures += _survivors_release(spec, survivors, record)
    failures += _rejoin(spec, request, peers, record, of_role)
    return failures


def _failed_before_kill(streams: list[_Stream], record: _Round) -> list[CheckFailure]:
    """A stream that ended in an error before the kill: the deployment did not serve the check's load while whole,
    so what the kill did to it proves less than it seems (seen: a router still sending every other request to a
    worker killed in the round before; `_whole_again` now waits that out)."""
    failed = [s.end for s in streams if s.end.before_kill and s.end.outcome != "served"]
    if not failed:
        return []
    first = failed[0]
    return [CheckFailure(NOT_EXERCISED, (
        f"{len(failed)} of {len(streams)} stream(s) ended with {first.outcome} before {record.victim} was killed "
        f"(status {first.status_code}: {first.error}): the deployment did not serve the load whole"))]  # fmt: skip


def _kill_moment(streams: list[_Stream], deadline: float) -> str:
    """Wait until every stream has its first token or one is halfway through its answer (or the deadline):
    the moment most of them are mid-answer. Says which it was, for the record."""
    while True:
        if all(s.first.is_set() for s in streams):
            return "every stream had its first token (or had ended)"
        if any(s.halfway.is_set() for s in streams):
            started = sum(s.first.is_set() for s in streams)
            return f"a stream was halfway through its answer ({started} of {len(streams)} had their first token)"
        if time.monotonic() >= deadline:
            return "the bound passed before every stream had its first token"
        time.sleep(0.01)


def _at_rest(survivors: tuple[EngineGauges, ...], timeout_s: float) -> tuple[dict[str, Reading], float | None]:
    """The survivors' gauges once they hold nothing (the level the release is judged against), and how long that
    took; the last reading and None if they still held something after `timeout_s`. A level taken while an
    engine still holds the previous request's KV would hide a block held for the dead peer just as big (seen on
    vLLM: one block before the streams, one block held for the dead decode after, "released" at once)."""
    started = time.monotonic()
    with loopback_client(5.0) as client:
        while True:
            reading = read_gauges(survivors, client)
            if all(not isinstance(r, str) and not any(r.values()) for r in reading.values()):
                return reading, round(time.monotonic() - started, 3)
            if time.monotonic() - started >= timeout_s:
                return reading, None
            time.sleep(POLL_S)


def _while_down(
    spec: PeerLossSpec, request: RequestSpec, record: _Round, of_role: int, waited_on: WaitedOn
) -> list[CheckFailure]:
    """One request per worker of the victim's role (so a round robin reaches the dead one): each must end in
    the bound; what it was (served, refused, served with no worker of the role left) is recorded."""
    bounded = RequestSpec(request.url, request.model, request.prompt, request.max_tokens, spec.bound_s,
                          request.max_response_bytes)  # fmt: skip
    for _ in range(of_role):
        response = send_chat(bounded)
        probe: dict[str, Any] = {"status_code": response.status_code, "request_s": response.request_s,
                                 "error": response.error}  # fmt: skip
        record.down_probes.append(probe)
        if response.error_kind == "timeout":
            evidence = waited_on(bounded, response.request_s or spec.bound_s)
            return [CheckFailure(HANG, (
                f"a request sent while {record.victim} was down got no answer within {spec.bound_s:g} s"
                + (f" (no other {record.role} worker was left: it must fail fast)" if of_role == 1 else "")
                + f"\n--- who waited on what ---\n{evidence}"))]  # fmt: skip
        if response.status_code == 200 and of_role == 1:
            probe["note"] = f"served with no {record.role} worker up (a fallback that does without it)"
    return []


def _survivors_release(spec: PeerLossSpec, survivors: tuple[EngineGauges, ...], record: _Round) -> list[CheckFailure]:
    started = time.monotonic()
    with loopback_client(5.0) as client:
        while True:
            record.survivors_after = read_gauges(survivors, client)
            held = released(record.survivors_before, record.survivors_after)
            if held and not record.survivors_held:
                record.survivors_held = held
            if not held:
                record.released_s = round(time.monotonic() - started, 3)
                return []
            if time.monotonic() - started >= spec.release_timeout_s:
                return [CheckFailure(KV_RELEASED, (
                    f"{spec.release_timeout_s:g} s after {record.victim} was killed and the requests to it ended, the "
                    f"survivors still hold work or KV: {'; '.join(held)}"))]  # fmt: skip
            time.sleep(POLL_S)


def _rejoin(spec: PeerLossSpec, request: RequestSpec, peers: Peers, record: _Round, of_role: int) -> list[CheckFailure]:
    victim = record.victim
    started = time.monotonic()
    record.new_pid = peers.restart_role(victim)
    why = peers.wait_role_ready(victim, spec.rejoin_timeout_s)
    if why is not None:
        return [CheckFailure(REJOIN, f"{victim} started again (pid {record.new_pid}) but {why}")]
    worker = next(w for w in spec.workers if w.name == victim)
    with loopback_client(5.0) as client:
        record.new_instance_id = instance_id(client, worker)
    key = "prefill_worker_id" if record.role == "prefill" else "decode_worker_id"
    for _ in range(REJOIN_TURNS * of_role):
        response = send_chat(request)
        validation = validate_chat_response(response.status_code, response.body) if response.body else None
        served_by = getattr(validation, key, None)
        record.served_after_rejoin.append({"status_code": response.status_code, key: served_by,
                                           "error": response.error})  # fmt: skip
        if response.status_code == 200 and served_by is not None and str(served_by) == record.new_instance_id:
            record.rejoined_s = round(time.monotonic() - started, 3)
            return _whole_again(spec, request, record, of_role, started)
    answered = sorted({str(s.get(key)) for s in record.served_after_rejoin})
    return [CheckFailure(REJOIN, (
        f"{victim} started again (pid {record.new_pid}, instance {record.new_instance_id}) and was ready, but none of "
        f"{len(record.served_after_rejoin)} request(s) after it was served by it (statuses "
        f"{sorted({str(s['status_code']) for s in record.served_after_rejoin})}, {key}s {answered})"))]  # fmt: skip


def _whole_again(spec: PeerLossSpec, request: RequestSpec, record: _Round, of_role: int, started: float
                 ) -> list[CheckFailure]:  # fmt: skip
    """After the new instance served, requests are sent one by one until a run of them in a row was served: a
    router may still send some to the dead instance until its registration runs out (Dynamo 1.6.1 with file
    discovery: every other request of a 1p1d cell got 503 at once). The next round, or the next cell's user,
    meets the deployment only once it is whole again; how long that took is recorded, and never getting there
    within `rejoin_timeout_s` of the restart fails the rejoin."""
    run = 2 * (of_role + 1)  # a round robin over the role's live workers and one dead entry, twice
    in_a_row = 0
    while in_a_row < run:
        refused = record.refused_after_rejoin
        if refused and time.monotonic() - started >= spec.rejoin_timeout_s:
            return [CheckFailure(REJOIN, (
                f"{record.victim} rejoined (instance {record.new_instance_id}) but {spec.rejoin_timeout_s:g} s after "
                f"its restart requests were still refused ({len(refused)} since it served, the last: status "
                f"{refused[-1]['status_code']}, {refused[-1]['error']}): the router still sends some to the dead "
                "instance"))]  # fmt: skip
        response = send_chat(request)
        if response.status_code == 200:
            in_a_row += 1
            continue
        in_a_row = 0
        record.refused_after_rejoin.append({"status_code": response.status_code, "error": response.error,
                                            "after_restart_s": round(time.monotonic() - started, 3)})  # fmt: skip
    record.whole_s = round(time.monotonic() - started, 3)
    return []


def _write(spec: PeerLossSpec, rounds: list[_Round]) -> None:
    document = {
        "check": "peer_loss", "bound_s": spec.bound_s, "release_timeout_s": spec.release_timeout_s,
        "rejoin_timeout_s": spec.rejoin_timeout_s, "streams": spec.streams, "stream_tokens": spec.stream_tokens,
        "rounds": [asdict(r) for r in rounds],
    }  # fmt: skip
    with contextlib.suppress(OSError):  # evidence only: a write error is not a check failure
        (Path(spec.record_dir) / "peer_loss.json").write_text(json.dumps(document, indent=1) + "\n", "utf-8")
