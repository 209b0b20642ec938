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

A streaming request (`vllm` protocol) is relayed chunk by chunk from decode's own stream, with one chunk
carrying `nvext.worker_id` before `[DONE]`. When the client goes away mid-stream the proxy closes its
connection to decode at once, so the engine sees the disconnect and aborts the request, as it would behind
any frontend: that is what the `cancel_recovers` check then reads from the engines' gauges.

    python -m matrix.pdproxy --port P --prefill-url http://127.0.0.1:A --decode-url http://127.0.0.1:B \
        [--protocol sglang --bootstrap-port C]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import http.client
import json
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from matrix.arm_table import PROTOCOLS
from matrix.reference.eventlog import EventLog
from matrix.reference.frontend import Upstream, call_worker, parse_upstream
from matrix.reference.http import AppServer, HTTPError, JSONHandler, Route, StopSignal, serve_until_stopped
from matrix.text import excerpt

# The fields vLLM's connector expects on a prefill-only request (the decode side fills them in).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def instance_id(role: str, url: str, engine_id: object = None) -> int:
    """A stable unsigned 64-bit id for an instance: the same instance always maps to the same id."""
    key = f"{role}|{url}|{engine_id or ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


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


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    request = copy.deepcopy(body)
    request.pop("nvext", None)
    request.pop("stream_options", None)
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    request["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return request


def decode_request(body: dict[str, Any], kv_transfer_params: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    request = copy.deepcopy(body)
    request.pop("nvext", None)
    request["stream"] = stream
    if not stream:
        request.pop("stream_options", None)
    request["kv_transfer_params"] = kv_transfer_params
    return request


def sglang_request(body: dict[str, Any], bootstrap_host: str, bootstrap_port: int, room: int) -> dict[str, Any]:
    """The request both SGLang instances get: the client's, non-streaming, with the pairing fields."""
    request = copy.deepcopy(body)
    request.pop("nvext", None)
    request.pop("stream_options", None)
    request["stream"] = False
    request |= {"bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    return request


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

    def routes(self) -> dict[tuple[str, str], Route]:
        return {
            ("GET", "/live"): lambda req: req.send_json(200, {"status": "live"}),
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): self.chat,
            # Plain completions take the same path (the equivalence oracle asks them for token ids).
            ("POST", "/v1/completions"): self.chat,
        }

    def health(self, req: JSONHandler) -> None:
        for up in (self.cfg.prefill, self.cfg.decode):
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

    def _answer(self, req: JSONHandler, decode: dict[str, Any], prefill_engine: object) -> None:
        nvext = decode.setdefault("nvext", {}) if isinstance(decode.get("nvext", {}), dict) else {}
        nvext["worker_id"] = {
            "prefill_worker_id": instance_id("prefill", self.cfg.prefill.url, prefill_engine),
            "decode_worker_id": instance_id("decode", self.cfg.decode.url),
        }
        decode["nvext"] = nvext
        req.send_json(200, decode)

    def _chat_vllm(self, req: JSONHandler, body: dict[str, Any]) -> None:
        prefill = _ok(self.cfg.prefill, *call_worker(self.cfg.prefill, "POST", req.route_path, prefill_request(body),
                                                     self.cfg.timeout_s))  # fmt: skip
        kv = prefill.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise HTTPError(502, "prefill instance returned no kv_transfer_params: is its KV connector a producer?")
        if body.get("stream"):
            self._relay_stream(req, decode_request(body, kv, stream=True), kv.get("remote_engine_id"))
            return
        decode = _ok(self.cfg.decode, *call_worker(self.cfg.decode, "POST", req.route_path, decode_request(body, kv),
                                                   self.cfg.timeout_s))  # fmt: skip
        self.log(f"chat prefill_engine={kv.get('remote_engine_id')} blocks={len(kv.get('remote_block_ids') or [])}")
        self._answer(req, decode, prefill_engine=kv.get("remote_engine_id"))

    def _worker_chunk(self, prefill_engine: object) -> bytes:
        """The SSE event that names both instances (a choice-less chunk, as Dynamo's frontend sends nvext)."""
        worker_id = {
            "prefill_worker_id": instance_id("prefill", self.cfg.prefill.url, prefill_engine),
            "decode_worker_id": instance_id("decode", self.cfg.decode.url),
        }
        chunk = {"object": "chat.completion.chunk", "choices": [], "nvext": {"worker_id": worker_id}}
        return b"data: " + json.dumps(chunk).encode("utf-8") + b"\n\n"

    def _relay_stream(self, req: JSONHandler, request: dict[str, Any], prefill_engine: object) -> None:
        """Decode's SSE stream to the client line by line; the upstream connection closes with the client's."""
        up = self.cfg.decode
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
            events = 0
            while line := resp.readline():
                if line.strip() == b"data: [DONE]":
                    req.wfile.write(self._worker_chunk(prefill_engine))
                events += line.startswith(b"data:")
                # A write to a client that went away raises here (BrokenPipe/ConnectionReset); the finally
                # below then drops decode's connection, which is how the engine learns of the cancel.
                req.wfile.write(line)
                req.wfile.flush()
            self.log(f"chat stream prefill_engine={prefill_engine} events={events}")
        except (BrokenPipeError, ConnectionResetError):
            self.log(f"chat stream client went away; closed decode's stream (prefill_engine={prefill_engine})")
        finally:
            conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrix.pdproxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-url", required=True)
    parser.add_argument("--decode-url", required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--protocol", choices=PROTOCOLS, default=PROTOCOLS[0])
    parser.add_argument("--bootstrap-port", type=int, help="sglang: the prefill server's bootstrap port")
    args = parser.parse_args(argv)
    if args.protocol == "sglang" and args.bootstrap_port is None:
        parser.error("--protocol sglang needs --bootstrap-port (the prefill server's bootstrap listener)")
    try:
        cfg = ProxyConfig(
            args.port, parse_upstream("prefill", args.prefill_url), parse_upstream("decode", args.decode_url),
            args.timeout_s, args.protocol, args.bootstrap_port,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    log = EventLog("pdproxy")
    stop = StopSignal(ignore_sigterm=False)
    try:
        server = AppServer(cfg.port, ProxyApp(cfg, log), log)
    except OSError as exc:
        log(f"error: cannot listen on 127.0.0.1:{cfg.port}: {exc}")
        return 1
    log(f"ready http=127.0.0.1:{cfg.port} prefill={cfg.prefill.url} decode={cfg.decode.url}")
    serve_until_stopped([server], stop, log)
    log("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
