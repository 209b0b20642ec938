"""matrix's own P/D proxy in front of a prefill and a decode instance, in one of two protocols.

`vllm` (vLLM's toy-proxy protocol): a chat completion goes to the prefill instance with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`; the `kv_transfer_params` it returns (which blocks, on
which engine, behind which side channel) go with the original request to the decode instance, which
pulls the KV cache and generates.

`sglang` (SGLang's P/D router protocol): the same request goes to both instances at once, carrying
`bootstrap_host`, `bootstrap_port` (the prefill server's bootstrap listener) and a fresh random
`bootstrap_room` that pairs the two halves; decode pre-allocates KV slots, prefill computes the prompt and
writes its KV into them, decode generates. Both must be in flight together: each waits for the other.

The answer is the decode instance's, plus `nvext.worker_id` naming the instance that served each phase as
a stable u64 (a hash of its role and address), so the same validation as every other arm applies.

xPyD ([M27], `vllm` protocol): `--prefill-url` and `--decode-url` repeated name several instances, "prefill",
"prefill_2"... in order; each request takes the next (prefill, decode) pair round robin as the reference
frontend does (over the prefills, and over the decodes once per full turn of them), so P x D requests use
every pair. With `--worker-ids` the answer also carries `nvext.worker_ids` (the pair per choice, as the
reference frontend reports it), `GET /workers/NAME/health` names each instance's id, and the event log
records each request's pair: what `matrix.check.topology` reads.

A streaming request (`vllm` protocol) is relayed chunk by chunk from decode's own stream, with one chunk
carrying `nvext.worker_id` before `[DONE]`. When the client goes away mid-stream the proxy closes its
connection to decode at once, so the engine sees the disconnect and aborts the request, as it would behind
any frontend: that is what the `cancel_recovers` check then reads from the engines' gauges.

    python -m matrix.pdproxy --port P --prefill-url http://127.0.0.1:A --decode-url http://127.0.0.1:B \
        [--protocol sglang --bootstrap-port C]
"""

from __future__ import annotations

import argparse
import functools
import http.client
import itertools
import json
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from matrix.arm_table import PROTOCOLS
from matrix.pdproxy_requests import decode_request, instance_id, prefill_request, sglang_request
from matrix.reference.eventlog import EventLog
from matrix.reference.frontend import Upstream, call_worker, parse_upstream
from matrix.reference.http import AppServer, HTTPError, JSONHandler, Route, StopSignal, serve_until_stopped
from matrix.text import excerpt

# The request builders and ids live in `matrix.pdproxy_requests`; importers of this module still find them here.
__all__ = ["ProxyApp", "ProxyConfig", "decode_request", "instance_id", "main", "prefill_request", "sglang_request"]

# The protocols of the arm table's rows (`arm_table.PROTOCOLS`, vLLM's first: the default). The proxy speaks
# vLLM's (the request as is) and SGLang's (a bootstrap room shared by both); a unit test holds the table to these.


@dataclass(frozen=True)
class ProxyConfig:
    port: int
    prefill: Upstream
    decode: Upstream
    timeout_s: float
    protocol: str = "vllm"
    # SGLang only: the prefill server's disaggregation bootstrap port.
    bootstrap_port: int | None = None
    # xPyD: the instances after the first of each role ("prefill_2"...), and whether answers name the pair
    # per choice (`nvext.worker_ids`; ids of address alone, so the check knows them before any request).
    more_prefills: tuple[Upstream, ...] = ()
    more_decodes: tuple[Upstream, ...] = ()
    worker_ids: bool = False

    @property
    def prefills(self) -> tuple[Upstream, ...]:
        return (self.prefill, *self.more_prefills)

    @property
    def decodes(self) -> tuple[Upstream, ...]:
        return (self.decode, *self.more_decodes)


def _status(up: Upstream, path: str) -> int:
    """HTTP status of a GET (vLLM's /health answers 200 with an empty body); 0 when unreachable."""
    conn = http.client.HTTPConnection(up.host, up.port, timeout=5.0)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def _ok(up: Upstream, status: int, obj: Any) -> dict[str, Any]:
    if status != 200 or not isinstance(obj, dict):
        message = obj.get("error", obj) if isinstance(obj, dict) else obj
        raise HTTPError(status if status >= 400 else 502, f"{up.role} instance answered HTTP {status}: {message!r}")
    return obj


class ProxyApp:
    def __init__(self, cfg: ProxyConfig, log: EventLog) -> None:
        self.cfg, self.log = cfg, log
        self._turn = itertools.count()

    def routes(self) -> dict[tuple[str, str], Route]:
        workers: dict[tuple[str, str], Route] = {
            ("GET", f"/workers/{up.role}/health"): functools.partial(self.worker_health, up)
            for up in (*self.cfg.prefills, *self.cfg.decodes)
            if self.cfg.worker_ids
        }
        return {
            ("GET", "/live"): lambda req: req.send_json(200, {"status": "live"}),
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): self.chat,
            # Plain completions take the same path (the equivalence oracle asks them for token ids).
            ("POST", "/v1/completions"): self.chat,
            **workers,
        }

    def route(self) -> tuple[Upstream, Upstream]:
        """The next request's (prefill, decode): round robin over the prefills, over the decodes once per full
        turn of the prefills (the reference frontend's order), so P x D requests use every pair."""
        turn, prefills, decodes = next(self._turn), self.cfg.prefills, self.cfg.decodes
        return prefills[turn % len(prefills)], decodes[(turn // len(prefills)) % len(decodes)]

    def ids(self, prefill: Upstream, decode: Upstream, prefill_engine: object) -> dict[str, int]:
        """The pair's ids; with `worker_ids` of address alone (one per instance, known before any request)."""
        engine = None if self.cfg.worker_ids else prefill_engine
        return {"prefill_worker_id": instance_id("prefill", prefill.url, engine),
                "decode_worker_id": instance_id("decode", decode.url)}  # fmt: skip

    def worker_health(self, up: Upstream, req: JSONHandler) -> None:
        """One instance's health and the id answers name it by (`matrix.check.topology` reads it)."""
        status = _status(up, "/health")
        if status != 200:
            raise HTTPError(503, f"{up.role} instance is not healthy (HTTP {status})", "service_unavailable")
        req.send_json(200, {"status": "healthy", "instance_id": instance_id(up.role.split("_")[0], up.url)})

    def health(self, req: JSONHandler) -> None:
        for up in (*self.cfg.prefills, *self.cfg.decodes):
            status = _status(up, "/health")
            if status != 200:
                raise HTTPError(503, f"{up.role} instance is not healthy (HTTP {status})", "service_unavailable")
        req.send_json(200, {"status": "healthy"})

    def models(self, req: JSONHandler) -> None:
        status, obj = call_worker(self.cfg.decode, "GET", "/v1/models", None, 5.0)
        req.send_json(status, obj)

    def chat(self, req: JSONHandler) -> None:
        body = req.read_json_object()
        if body.get("stream") and self.cfg.protocol == "sglang":
            raise HTTPError(400, "matrix's P/D proxy streams the vllm protocol only")
        if self.cfg.protocol == "sglang":
            self._chat_sglang(req, body)
        else:
            self._chat_vllm(req, body)

    def _chat_sglang(self, req: JSONHandler, body: dict[str, Any]) -> None:
        # SGLang's router draws a random room per request; 63 bits keep it a positive signed integer.
        room = secrets.randbits(63)
        assert self.cfg.bootstrap_port is not None  # checked in main()
        request = sglang_request(body, self.cfg.prefill.host, self.cfg.bootstrap_port, room)
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="pd") as pool:
            calls = {
                up.role: pool.submit(call_worker, up, "POST", req.route_path, request, self.cfg.timeout_s)
                for up in (self.cfg.prefill, self.cfg.decode)
            }
            # Decode's answer is the client's; a prefill error is reported first, as it is the cause.
            prefill_result, decode_result = calls["prefill"].result(), calls["decode"].result()
        _ok(self.cfg.prefill, *prefill_result)
        decode = _ok(self.cfg.decode, *decode_result)
        self._answer(req, decode, prefill_engine=None)
        self.log(f"chat bootstrap_room={room}")

    def _nvext(self, pair: tuple[Upstream, Upstream], prefill_engine: object, choices: int) -> dict[str, Any]:
        """`worker_id` names the pair; with `worker_ids`, `worker_ids` names it per choice too."""
        ids = self.ids(*pair, prefill_engine)
        per_choice = [{"index": k, **ids} for k in range(choices)]
        return {"worker_id": ids, **({"worker_ids": per_choice} if self.cfg.worker_ids else {})}

    def _answer(self, req: JSONHandler, decode: dict[str, Any], prefill_engine: object,
                pair: tuple[Upstream, Upstream] | None = None) -> None:  # fmt: skip
        nvext = decode.setdefault("nvext", {}) if isinstance(decode.get("nvext", {}), dict) else {}
        choices = decode.get("choices")
        nvext.update(self._nvext(pair or (self.cfg.prefill, self.cfg.decode), prefill_engine,
                                 len(choices) if isinstance(choices, list) else 1))  # fmt: skip
        decode["nvext"] = nvext
        req.send_json(200, decode)

    def _chat_vllm(self, req: JSONHandler, body: dict[str, Any]) -> None:
        pair = pre, dec = self.route()
        prefill = _ok(pre, *call_worker(pre, "POST", req.route_path, prefill_request(body), self.cfg.timeout_s))
        kv = prefill.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise HTTPError(502, "prefill instance returned no kv_transfer_params: is its KV connector a producer?")
        # xPyD: each request's pair is recorded (the 1P1D pair's line stays as it was).
        named = f" prefill={pre.role} decode={dec.role}" if self.cfg.worker_ids else ""
        try:
            if body.get("stream"):
                self._relay_stream(req, decode_request(body, kv, stream=True), kv.get("remote_engine_id"), pair, named)
                return
            decode = _ok(dec, *call_worker(dec, "POST", req.route_path, decode_request(body, kv), self.cfg.timeout_s))
        except HTTPError as exc:
            # Prefill made KV that no decode will pull: it holds it until its own timeout. The line names the
            # prefill's request, as the engine's log names it when it lets it go (vLLM: its KV lease).
            self.log(f"chat{named} decode failed (HTTP {exc.status}): prefill's KV of request "
                     f"{kv.get('remote_request_id')} ({len(kv.get('remote_block_ids') or [])} blocks, engine "
                     f"{kv.get('remote_engine_id')}) left unclaimed: {exc.message}")  # fmt: skip
            raise
        self.log(f"chat{named} prefill_engine={kv.get('remote_engine_id')} "
                 f"blocks={len(kv.get('remote_block_ids') or [])}")  # fmt: skip
        self._answer(req, decode, kv.get("remote_engine_id"), pair)

    def _cut_stream(self, req: JSONHandler, up: Upstream, events: int, cause: Exception | None, named: str,
                    prefill_engine: object) -> None:  # fmt: skip
        """Decode's stream broke before [DONE]: the client gets an error event and then [DONE] (as vLLM's own
        server ends a stream that failed mid-way), never a stream that stops without a word, nor one that
        looks complete; the proxy's log names the instance and what cut it."""
        why = f"{type(cause).__name__}: {cause}" if cause is not None else "the stream closed without [DONE]"
        message = f"{up.role} instance at {up.url} ended the stream before the answer was complete ({why})"
        error = {"error": {"message": message, "type": "service_unavailable", "code": 503}}
        req.wfile.write(b"data: " + json.dumps(error).encode("utf-8") + b"\n\ndata: [DONE]\n\n")
        req.wfile.flush()
        self.log(f"chat stream{named} cut by {up.role} after {events} events: {why} (prefill_engine={prefill_engine})")

    def _worker_chunk(self, prefill_engine: object, pair: tuple[Upstream, Upstream], choices: int) -> bytes:
        """The SSE event that names both instances (a choice-less chunk, as Dynamo's frontend sends nvext)."""
        chunk = {"object": "chat.completion.chunk", "choices": [], "nvext": self._nvext(pair, prefill_engine, choices)}
        return b"data: " + json.dumps(chunk).encode("utf-8") + b"\n\n"

    def _relay_stream(self, req: JSONHandler, request: dict[str, Any], prefill_engine: object,
                      pair: tuple[Upstream, Upstream], named: str = "") -> None:  # fmt: skip
        """Decode's SSE stream to the client line by line; the upstream connection closes with the client's."""
        up = pair[1]
        conn = http.client.HTTPConnection(up.host, up.port, timeout=self.cfg.timeout_s)
        try:
            try:
                payload = json.dumps(request).encode("utf-8")
                conn.request("POST", req.route_path, body=payload, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
            except TimeoutError as exc:
                raise HTTPError(504, f"decode instance at {up.url} timed out", "timeout") from exc
            except (OSError, http.client.HTTPException) as exc:
                raise HTTPError(503, f"decode instance at {up.url} unreachable: {exc}", "service_unavailable") from exc
            if resp.status != 200:
                said = excerpt(resp.read().decode("utf-8", "replace"), 300)  # redacted whole, then cut
                raise HTTPError(resp.status if resp.status >= 400 else 502,
                                f"decode instance answered HTTP {resp.status}: {said!r}")  # fmt: skip
            req.send_response(200)
            req.send_header("Content-Type", "text/event-stream")
            req.send_header("Cache-Control", "no-cache")
            req.end_headers()
            events, done = 0, False
            while line := _upstream_line(resp):
                if isinstance(line, Exception):  # decode died or dropped the stream mid-answer
                    self._cut_stream(req, up, events, line, named, prefill_engine)
                    return
                if line.strip() == b"data: [DONE]":
                    done = True
                    req.wfile.write(self._worker_chunk(prefill_engine, pair, int(request.get("n") or 1)))
                events += line.startswith(b"data:")
                # A write to a client that went away raises here (BrokenPipe/ConnectionReset); the finally
                # below then drops decode's connection, which is how the engine learns of the cancel.
                req.wfile.write(line)
                req.wfile.flush()
            if not done:  # the stream ended cleanly, but before decode said [DONE]
                self._cut_stream(req, up, events, None, named, prefill_engine)
                return
            self.log(f"chat stream{named} prefill_engine={prefill_engine} events={events}")
        except (BrokenPipeError, ConnectionResetError):
            self.log(f"chat stream{named} client went away; closed decode's stream (prefill_engine={prefill_engine})")
        finally:
            conn.close()


def _upstream_line(resp: http.client.HTTPResponse) -> bytes | Exception:
    """The next line of decode's stream (b"" at its end), or the error that cut it: an instance killed
    mid-answer resets the connection or leaves a chunked body unfinished (IncompleteRead)."""
    try:
        return resp.readline()
    except (OSError, http.client.HTTPException) as exc:
        return exc


def _upstreams(role: str, urls: list[str]) -> tuple[Upstream, ...]:
    """`role`'s instances in order, named as the arms name their processes: "decode", "decode_2"..."""
    parsed = [parse_upstream(role, url) for url in urls]
    return tuple(replace(up, role=role if i == 1 else f"{role}_{i}") for i, up in enumerate(parsed, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrix.pdproxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-url", required=True, action="append", help="repeated: xPyD, vllm protocol")
    parser.add_argument("--decode-url", required=True, action="append", help="repeated: xPyD, vllm protocol")
    parser.add_argument("--worker-ids", action="store_true", help="name each choice's pair, each instance's id")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--protocol", choices=PROTOCOLS, default=PROTOCOLS[0])
    parser.add_argument("--bootstrap-port", type=int, help="sglang: the prefill server's bootstrap port")
    args = parser.parse_args(argv)
    if args.protocol == "sglang" and args.bootstrap_port is None:
        parser.error("--protocol sglang needs --bootstrap-port (the prefill server's bootstrap listener)")
    if args.protocol == "sglang" and len(args.prefill_url) + len(args.decode_url) > 2:
        parser.error("several --prefill-url/--decode-url: the vllm protocol only")
    try:
        prefills, decodes = _upstreams("prefill", args.prefill_url), _upstreams("decode", args.decode_url)
        cfg = ProxyConfig(args.port, prefills[0], decodes[0], args.timeout_s, args.protocol, args.bootstrap_port,
                          prefills[1:], decodes[1:], args.worker_ids)  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    log = EventLog("pdproxy")
    stop = StopSignal(ignore_sigterm=False)
    try:
        server = AppServer(cfg.port, ProxyApp(cfg, log), log)
    except OSError as exc:
        log(f"error: cannot listen on 127.0.0.1:{cfg.port}: {exc}")
        return 1
    log(f"ready http=127.0.0.1:{cfg.port} prefill={','.join(u.url for u in cfg.prefills)} "
        f"decode={','.join(u.url for u in cfg.decodes)}")  # fmt: skip
    serve_until_stopped([server], stop, log)
    log("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
