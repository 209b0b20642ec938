"""The frontend: OpenAI-style chat completions routed through prefill then decode, in Dynamo's shape."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from matrix.reference.eventlog import EventLog
from matrix.reference.faults import FRONTEND_FAULTS, UNBOUNDED_WAIT_FAULTS, slowdown
from matrix.reference.http import (
    AppServer,
    HTTPError,
    JSONHandler,
    Route,
    StopSignal,
    error_body,
    serve_until_stopped,
)

DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 8
MAX_TOKENS_LIMIT = 65_536
# oversized-body pads past this, the usual response cap of a careful client.
OVERSIZE_BYTES = 8 * 1024 * 1024 + 4096
_WRITE_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Upstream:
    """One worker as the frontend sees it."""

    role: str
    url: str
    host: str
    port: int


def parse_upstream(role: str, url: str) -> Upstream:
    """Validate `--prefill-url`/`--decode-url`: plain http with a host and an explicit port."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"--{role}-url must look like http://127.0.0.1:PORT, got {url!r}")
    return Upstream(role, url.rstrip("/"), parts.hostname, parts.port)


@dataclass(frozen=True)
class FrontendConfig:
    """`prefills` and `decodes`: one worker each for a 1P1D pair, several for an xPyD topology ([M27])."""

    port: int
    prefills: tuple[Upstream, ...]
    decodes: tuple[Upstream, ...]
    model: str
    faults: frozenset[str]
    max_body_bytes: int
    worker_timeout_s: float


# Faults that rewrite or delay the whole answer: a stream under them is assembled first, then sent.
WHOLE_ANSWER_FAULTS = frozenset(
    {"empty-completion", "hostile-output", "non-json-body", "oversized-body", "slow-request"}
)


def call_worker(up: Upstream, method: str, path: str, body: Any, timeout_s: float | None) -> tuple[int, Any]:
    """One JSON call to a worker; connection trouble becomes 503/504, non-JSON replies 502."""
    conn = http.client.HTTPConnection(up.host, up.port, timeout=timeout_s)
    try:
        payload = None if body is None else json.dumps(body).encode("utf-8")
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        status = resp.status
    except TimeoutError as exc:
        raise HTTPError(504, f"{up.role} worker at {up.url} timed out after {timeout_s:g}s", "timeout") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise HTTPError(503, f"{up.role} worker at {up.url} unreachable: {exc}", "service_unavailable") from exc
    finally:
        conn.close()
    try:
        return status, json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HTTPError(502, f"{up.role} worker answered HTTP {status} with a non-JSON body", "bad_gateway") from exc


def _checked(up: Upstream, status: int, obj: Any) -> dict[str, Any]:
    """The worker's JSON object, or its error re-raised with the worker's own status."""
    if status >= 400:
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            raise HTTPError(status, f"{up.role} worker: {err['message']}", str(err.get("type", "worker_error")))
        raise HTTPError(status, f"{up.role} worker answered HTTP {status}: {obj!r}", "worker_error")
    if not isinstance(obj, dict):
        raise HTTPError(502, f"{up.role} worker answered a JSON {type(obj).__name__}, not an object")
    return obj


def _prompt(messages: Any) -> str:
    """The last user message's text (a string, or the text parts of a content list)."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list")
    for msg in reversed(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                return "\n".join(t for t in texts if isinstance(t, str))
            raise HTTPError(400, "the last user message has no text content")
    raise HTTPError(400, "messages contain no user message")


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise HTTPError(400, f"max_tokens must be an integer from 1 to {MAX_TOKENS_LIMIT}")
    return value


class FrontendApp:
    """Routes of the frontend; stateless apart from its configuration and the round robin's position."""

    def __init__(self, cfg: FrontendConfig, log: EventLog) -> None:
        self.cfg = cfg
        self.log = log
        self._turn = 0
        self._turn_lock = threading.Lock()
        # Fault dead-peer-never-rejoins: the workers this frontend once failed to reach, dropped for good.
        self._dropped: set[Upstream] = set()
        # Fault dead-peer-still-routed: an entry per worker it once failed to reach, kept in the round robin for
        # good beside the worker's own (which serves again once it is back), as a registration never expired.
        self._ghosts: dict[Upstream, Upstream] = {}

    def route(self) -> tuple[Upstream, Upstream]:
        """The (prefill, decode) workers of the next request (each child of an `n > 1` request is one):
        round robin over the prefills, and over the decodes once per full turn of the prefills, so a 2p2d
        topology uses every pair in four requests. Fault topology-decode-unused leaves the last decode out."""
        with self._turn_lock:
            turn, self._turn = self._turn, self._turn + 1
        prefills, decodes = self.cfg.prefills, self.cfg.decodes
        if "topology-decode-unused" in self.cfg.faults and len(decodes) > 1:
            decodes = decodes[:-1]
        if self._dropped:
            prefills = tuple(up for up in prefills if up not in self._dropped)
            decodes = tuple(up for up in decodes if up not in self._dropped)
            if not prefills or not decodes:
                raise HTTPError(503, "no prefill or decode worker left to route to", "service_unavailable")
        ghosts = tuple(self._ghosts.values())
        prefills += tuple(g for g in ghosts if g.role == "prefill")
        decodes += tuple(g for g in ghosts if g.role == "decode")
        pair = prefills[turn % len(prefills)], decodes[(turn // len(prefills)) % len(decodes)]
        for up in pair:
            if up in ghosts:
                raise HTTPError(503, f"{up.role} worker at {up.url} unreachable: the entry of a dead instance "
                                "(fault dead-peer-still-routed)", "service_unavailable")  # fmt: skip
        return pair

    def unreachable(self, up: Upstream, exc: HTTPError) -> HTTPError:
        """A worker could not be reached (a dead peer): the error to answer with, after the faults that make
        a frontend handle it badly had their way (hang for good; drop the worker for good)."""
        if "dead-peer-hang" in self.cfg.faults:
            self.log(f"{up.role} worker at {up.url} unreachable: waiting for it forever (fault dead-peer-hang)")
            threading.Event().wait()
        if "dead-peer-still-routed" in self.cfg.faults and up not in self._ghosts:
            self._ghosts[up] = Upstream(up.role, f"{up.url}#dead", up.host, up.port)
            self.log(f"{up.role} worker at {up.url} unreachable: its entry stays routed for good "
                     "(fault dead-peer-still-routed)")  # fmt: skip
        if "dead-peer-never-rejoins" in self.cfg.faults:
            self._dropped.add(up)
            self.log(f"{up.role} worker at {up.url} dropped for good (fault dead-peer-never-rejoins)")
        return exc

    def routes(self) -> dict[tuple[str, str], Route]:
        return {
            ("GET", "/live"): self.live,
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
        }

    def live(self, req: JSONHandler) -> None:
        req.send_json(200, {"status": "live"})

    def models(self, req: JSONHandler) -> None:
        req.send_json(
            200,
            {
                "object": "list",
                "data": [{"id": self.cfg.model, "object": "model", "owned_by": "matrix-reference"}],
            },
        )

    def health(self, req: JSONHandler) -> None:
        """Healthy only when both workers answer their own /health as the role they were given."""
        instances: list[dict[str, Any]] = []
        errors: list[str] = []
        for up in dict.fromkeys((*self.cfg.prefills, *self.cfg.decodes)):  # aggregated: one worker, both roles
            try:
                status, obj = call_worker(up, "GET", "/health", None, 2.0)
            except HTTPError as exc:
                errors.append(exc.message)
                continue
            if status != 200 or not isinstance(obj, dict) or obj.get("status") != "ready":
                errors.append(f"{up.role} worker at {up.url} is not ready (HTTP {status})")
            elif obj.get("role") != up.role:
                errors.append(f"worker at {up.url} has role {obj.get('role')!r}, expected {up.role!r}")
            else:
                instances.append({"role": up.role, "instance_id": obj.get("instance_id"), "url": up.url})
        if errors:
            req.send_json(503, {"status": "unhealthy", "instances": instances, "errors": errors})
        else:
            req.send_json(200, {"status": "healthy", "instances": instances})

    def chat(self, req: JSONHandler) -> None:
        started = time.monotonic()
        body = req.read_json_object(self.cfg.max_body_bytes)
        model = body.get("model")
        if not isinstance(model, str):
            raise HTTPError(400, "model is required")
        if model != self.cfg.model:
            raise HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError")
        if body.get("n", 1) != 1:
            raise HTTPError(400, "only n=1 is supported")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HTTPError(400, "stream must be a boolean")
        prompt = _prompt(body.get("messages"))
        max_tokens = _max_tokens(body)
        request_id = f"chatcmpl-{os.urandom(12).hex()}"
        if stream and not self.cfg.faults & WHOLE_ANSWER_FAULTS:
            self._stream_live(req, request_id, prompt, max_tokens)
            return

        prefill, decode = self._prefill_decode(request_id, prompt, max_tokens)

        faults = self.cfg.faults
        prefill_id = prefill.get("prefill_worker_id")
        decode_id = prefill_id if "same-worker-id" in faults else decode.get("decode_worker_id")
        text = "" if "empty-completion" in faults else str(decode.get("text", ""))
        if "hostile-output" in faults:
            from matrix.reference.hostile import COMPLETION

            text = COMPLETION
        finish = "abort" if "bad-finish-reason" in faults else decode.get("finish_reason", "length")
        prompt_tokens = int(prefill.get("prompt_tokens", 0))
        completion_tokens = int(decode.get("completion_tokens", 0))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        nvext = {"worker_id": {"prefill_worker_id": prefill_id, "decode_worker_id": decode_id}}
        self.log(
            f"chat id={request_id} prompt_tokens={prompt_tokens} completion_tokens={completion_tokens} "
            f"stream={stream} ms={(time.monotonic() - started) * 1000:.1f}"
        )

        if "slow-request" in faults:
            # The planted regression: the whole answer (first byte included) comes later by a fraction of the
            # time it took, so request time and TTFT grow by that fraction, as a slower engine's would.
            time.sleep((time.monotonic() - started) * slowdown(os.environ))
        if "non-json-body" in faults:
            req.send_bytes(200, b"Internal Server Error: engine returned no result\n", "text/plain; charset=utf-8")
            return
        created = int(time.time())
        if stream and "oversized-body" not in faults:
            self._stream(req, request_id, created, text, finish, usage, nvext)
            return
        response: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.cfg.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": usage,
            "nvext": nvext,
        }
        if "missing-usage" in faults:
            del response["usage"]
        if "oversized-body" in faults:
            self._send_oversized(req, response)
            return
        req.send_json(200, response)

    def _stream_live(self, req: JSONHandler, request_id: str, prompt: str, max_tokens: int) -> None:
        """A stream relayed token by token from decode's own stream, so a client that drops it reaches
        decode: the frontend closes decode's connection at once, as an engine's frontend aborts the request."""
        timeout = self.cfg.worker_timeout_s
        pre, dec = self.route()
        prefill = _checked(
            pre, *self._call(pre, "POST", "/prefill", {"request_id": request_id, "prompt": prompt}, timeout)
        )
        body = json.dumps({"request_id": request_id, "kv": prefill.get("kv"), "max_tokens": max_tokens,
                           "stream": True}).encode("utf-8")  # fmt: skip
        wait = None if self.cfg.faults & UNBOUNDED_WAIT_FAULTS else timeout
        conn = http.client.HTTPConnection(dec.host, dec.port, timeout=wait)
        try:
            try:
                conn.request("POST", "/decode", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                error = HTTPError(503, f"decode worker at {dec.url} unreachable: {exc}", "service_unavailable")
                raise self.unreachable(dec, error) from exc
            if resp.status != 200:
                raw = resp.read()
                try:
                    obj: Any = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    obj = raw[:300]
                _checked(dec, resp.status, obj)
            self._relay(req, resp, request_id, prefill, dec)
        finally:
            conn.close()

    def _call(self, up: Upstream, method: str, path: str, body: Any, timeout_s: float | None) -> tuple[int, Any]:
        """`call_worker`, with an unreachable worker handled as `unreachable` says."""
        try:
            return call_worker(up, method, path, body, timeout_s)
        except HTTPError as exc:
            if exc.kind != "service_unavailable":
                raise
            raise self.unreachable(up, exc) from exc

    def _relay(
        self,
        req: JSONHandler,
        resp: http.client.HTTPResponse,
        request_id: str,
        prefill: dict[str, Any],
        dec: Upstream,
    ) -> None:
        created = int(time.time())
        req.send_response(200)
        req.send_header("Content-Type", "text/event-stream")
        req.send_header("Cache-Control", "no-cache")
        req.end_headers()

        def chunk(delta: dict[str, Any], finish_reason: Any = None, **extra: Any) -> None:
            obj = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}  # fmt: skip
            req.wfile.write(b"data: " + json.dumps(obj).encode("utf-8") + b"\n\n")
            req.wfile.flush()

        chunk({"role": "assistant", "content": ""})
        end: dict[str, Any] = {}
        first = True
        while line := _read_line(resp):
            event = json.loads(line)
            if event.get("done"):
                end = event
                break
            chunk({"content": str(event.get("text", "")) if first else " " + str(event.get("text", ""))})
            first = False
        faults = self.cfg.faults
        if not end and "dead-peer-truncation" not in faults:
            # Decode's stream ended before its last event (the worker died): say so in the stream, as an
            # engine's frontend does, instead of finishing the answer as if it were whole.
            self.unreachable(dec, HTTPError(503, "", "service_unavailable"))
            message = f"decode worker at {dec.url} ended the stream before the answer was complete"
            req.wfile.write(b"data: " + json.dumps(error_body(503, message, "service_unavailable")).encode() + b"\n\n")
            req.wfile.write(b"data: [DONE]\n\n")
            req.wfile.flush()
            self.log(f"chat id={request_id} stream=live error: {message}")
            return
        prefill_id = prefill.get("prefill_worker_id")
        decode_id = prefill_id if "same-worker-id" in faults else end.get("decode_worker_id")
        prompt_tokens, completion_tokens = int(prefill.get("prompt_tokens", 0)), int(end.get("completion_tokens", 0))
        final: dict[str, Any] = {
            "nvext": {"worker_id": {"prefill_worker_id": prefill_id, "decode_worker_id": decode_id}}
        }
        if "missing-usage" not in faults:
            final["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
        chunk({}, "abort" if "bad-finish-reason" in faults else end.get("finish_reason", "length"), **final)
        req.wfile.write(b"data: [DONE]\n\n")
        req.wfile.flush()
        self.log(f"chat id={request_id} stream=live completion_tokens={completion_tokens}")

    def _prefill_decode(
        self, request_id: str, prompt: str, max_tokens: int, kv: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """vLLM's toy-proxy flow: prefill builds the KV cache, decode pulls it and generates (`kv`: the
        handle decode is given instead of a prefill of its own, fault n-child-handoff-lost)."""
        timeout = self.cfg.worker_timeout_s
        pre, dec = self.route()
        prefill = (
            {"kv": kv}
            if kv is not None
            else _checked(
                pre, *self._call(pre, "POST", "/prefill", {"request_id": request_id, "prompt": prompt}, timeout)
            )
        )
        decode_req = {"request_id": request_id, "kv": prefill.get("kv"), "max_tokens": max_tokens}
        # kv-transfer-stall: a gateway without a timeout of its own waits for decode as long as decode waits.
        wait = None if self.cfg.faults & UNBOUNDED_WAIT_FAULTS else timeout
        return prefill, _checked(dec, *self._call(dec, "POST", "/decode", decode_req, wait))

    def completions(self, req: JSONHandler) -> None:
        """A plain-text completion in vLLM's shape, with `logprobs` (top-N per token, N <= 2 here) and
        `return_tokens_as_token_ids` ("token_id:N" for every token): what the equivalence oracle asks. `n`
        choices (each its own prefill and decode, as an engine forks a request's children) and `stream`
        (SSE chunks relayed from decode's stream, one per token): what the traffic check asks."""
        body = req.read_json_object(self.cfg.max_body_bytes)
        if body.get("model") != self.cfg.model:
            raise HTTPError(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise HTTPError(400, "prompt must be a string")
        n, stream = body.get("n", 1), body.get("stream", False)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise HTTPError(400, f"n must be an integer from 1 to {MAX_CHOICES}")
        if not isinstance(stream, bool):
            raise HTTPError(400, "stream must be a boolean")
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise HTTPError(400, "logprobs must be a non-negative integer")
        request_id = f"cmpl-{os.urandom(12).hex()}"
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        max_tokens = _max_tokens(body)
        if stream:
            self._stream_completion(req, request_id, prompt, max_tokens, n, logprobs, as_ids)
            return
        choices: list[dict[str, Any]] = []
        workers: list[dict[str, Any]] = []  # each choice's (prefill, decode) worker ids, as chat's nvext
        prompt_tokens = completion_tokens = 0
        first_kv: Any = None
        for k in range(n):
            child = request_id if n == 1 else f"{request_id}-{k}"
            try:
                prefill, decode = self._prefill_decode(child, prompt, max_tokens, self._lost(k, first_kv))
            except HTTPError:
                if not self._lost(k, first_kv):
                    raise
                # The child's handoff never came: like the engine of dynamo #14018, answer without it.
                choices.append({"index": k, "text": "", "logprobs": None, "finish_reason": "abort"})
                continue
            first_kv = first_kv or prefill.get("kv")
            workers.append(_worker_ids(k, prefill.get("kv"), decode.get("decode_worker_id")))
            ids = [int(t) for t in decode.get("token_ids", [])]
            choices.append(_completion_choice(k, ids, decode.get("top_logprobs", []), logprobs, as_ids))
            prompt_tokens = int(prefill.get("prompt_tokens", 0))
            completion_tokens += len(ids)
        self.log(f"completion id={request_id} n={n} prompt_tokens={prompt_tokens} "
                 f"completion_tokens={completion_tokens}")  # fmt: skip
        req.send_json(
            200,
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.cfg.model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
                "nvext": {"worker_ids": workers},
            },
        )

    def _decode_stream(
        self, child: str, prompt: str, max_tokens: int, kv: Any, wait: float | None
    ) -> tuple[Any, http.client.HTTPConnection, http.client.HTTPResponse]:
        """One child's prefill (unless `kv` is given) and its decode stream, open; errors as HTTPError."""
        pre, dec = self.route()
        request = {"request_id": child, "prompt": prompt}
        kv = kv or _checked(pre, *self._call(pre, "POST", "/prefill", request, self.cfg.worker_timeout_s))["kv"]
        body = json.dumps({"request_id": child, "kv": kv, "max_tokens": max_tokens, "stream": True}).encode("utf-8")
        conn = http.client.HTTPConnection(dec.host, dec.port, timeout=wait)
        try:
            conn.request("POST", "/decode", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raw = resp.read()
                try:
                    obj: Any = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    obj = raw[:300]
                _checked(dec, resp.status, obj)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise HTTPError(503, f"decode worker at {dec.url} unreachable: {exc}", "service_unavailable") from exc
        except HTTPError:
            conn.close()
            raise
        return kv, conn, resp

    def _lost(self, child: int, first_kv: Any) -> Any:
        """Fault n-child-handoff-lost: every child after the first is handed the first child's KV handle,
        which prefill already sent and freed, instead of its own; None: the child runs its own prefill."""
        return first_kv if child > 0 and "n-child-handoff-lost" in self.cfg.faults else None

    def _stream_completion(
        self, req: JSONHandler, request_id: str, prompt: str, max_tokens: int, n: int, logprobs: Any, as_ids: bool
    ) -> None:
        """SSE completion chunks, one per token, each choice relayed from its own decode stream in turn."""
        wait = None if self.cfg.faults & UNBOUNDED_WAIT_FAULTS else self.cfg.worker_timeout_s
        created = int(time.time())
        started = False
        first_kv: Any = None

        def chunk(choice: dict[str, Any], **extra: Any) -> None:
            obj = {"id": request_id, "object": "text_completion", "created": created, "model": self.cfg.model,
                   "choices": [choice], **extra}  # fmt: skip
            req.wfile.write(b"data: " + json.dumps(obj).encode("utf-8") + b"\n\n")
            req.wfile.flush()

        for k in range(n):
            child = request_id if n == 1 else f"{request_id}-{k}"
            lost = self._lost(k, first_kv)
            try:
                kv, conn, resp = self._decode_stream(child, prompt, max_tokens, lost, wait)
            except HTTPError:
                if lost is None:
                    raise
                chunk({"index": k, "text": "", "logprobs": None, "finish_reason": "abort"})  # dynamo #14018
                continue
            first_kv = first_kv or kv
            if not started:
                req.send_response(200)
                req.send_header("Content-Type", "text/event-stream")
                req.send_header("Cache-Control", "no-cache")
                req.end_headers()
                started = True
            end: dict[str, Any] = {}
            try:
                while line := resp.readline():
                    event = json.loads(line)
                    if event.get("done"):
                        end = event
                        break
                    tok = int(event["token_id"])
                    top = [event["top"]] if event.get("top") else []
                    choice = _completion_choice(k, [tok], top, logprobs, as_ids)
                    choice["finish_reason"] = None
                    chunk(choice)
            finally:
                conn.close()
            workers = {"worker_ids": [_worker_ids(k, kv, end.get("decode_worker_id"))]}
            chunk({"index": k, "text": "", "logprobs": None, "finish_reason": "length"}, nvext=workers)
        req.wfile.write(b"data: [DONE]\n\n")
        req.wfile.flush()
        self.log(f"completion id={request_id} n={n} stream=live")

    def _stream(
        self,
        req: JSONHandler,
        request_id: str,
        created: int,
        text: str,
        finish: Any,
        usage: dict[str, int],
        nvext: dict[str, Any],
    ) -> None:
        """SSE chunks: the role, one chunk per word, then finish_reason with usage and nvext, then [DONE]."""
        req.send_response(200)
        req.send_header("Content-Type", "text/event-stream")
        req.send_header("Cache-Control", "no-cache")
        req.end_headers()

        def chunk(delta: dict[str, Any], finish_reason: Any = None, **extra: Any) -> None:
            obj = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.cfg.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                **extra,
            }
            req.wfile.write(b"data: " + json.dumps(obj).encode("utf-8") + b"\n\n")
            req.wfile.flush()

        chunk({"role": "assistant", "content": ""})
        for i, word in enumerate(text.split(" ") if text else []):
            chunk({"content": word if i == 0 else " " + word})
        final: dict[str, Any] = {"nvext": nvext}
        if "missing-usage" not in self.cfg.faults:
            final["usage"] = usage
        chunk({}, finish, **final)
        req.wfile.write(b"data: [DONE]\n\n")
        req.wfile.flush()

    def _send_oversized(self, req: JSONHandler, response: dict[str, Any]) -> None:
        """Fault oversized-body: valid JSON past 8 MiB, written in pieces with no Content-Length,
        so a client only finds out by counting what it reads."""
        response["padding"] = "x" * OVERSIZE_BYTES
        body = json.dumps(response).encode("utf-8")
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.end_headers()
        view = memoryview(body)
        for start in range(0, len(body), _WRITE_CHUNK):
            req.wfile.write(view[start : start + _WRITE_CHUNK])
        req.wfile.flush()


def _read_line(resp: http.client.HTTPResponse) -> bytes:
    """The next line of a worker's stream; b"" once it ended, however it ended (a worker that died resets it)."""
    try:
        return resp.readline()
    except (OSError, http.client.HTTPException):
        return b""


def _worker_ids(index: int, kv: Any, decode_id: Any) -> dict[str, Any]:
    """Which workers served choice `index`: the prefill that made its KV (named in the KV handle) and the
    decode that generated it."""
    prefill_id = kv.get("prefill_worker_id") if isinstance(kv, dict) else None
    return {"index": index, "prefill_worker_id": prefill_id, "decode_worker_id": decode_id}


def _completion_choice(index: int, ids: list[int], top: list[Any], logprobs: Any, as_ids: bool) -> dict[str, Any]:
    """One completions choice of token ids `ids` and their top (id, logprob) pairs, in vLLM's shape."""
    from matrix.reference.tokens import detokenize_one

    def name(tok: int) -> str:
        return f"token_id:{tok}" if as_ids else detokenize_one(tok)

    words = [detokenize_one(t) for t in ids]
    choice: dict[str, Any] = {"index": index, "text": " ".join(words), "logprobs": None, "finish_reason": "length"}
    if logprobs is not None:
        offsets = [sum(len(w) + 1 for w in words[:i]) for i in range(len(words))]
        choice["logprobs"] = {
            "text_offset": offsets,
            "token_logprobs": [float(pos[0][1]) for pos in top],
            "tokens": [name(t) for t in ids],
            "top_logprobs": [{name(int(t)): float(lp) for t, lp in pos[: max(logprobs, 1)]} for pos in top],
        }
    return choice


def run_frontend(cfg: FrontendConfig) -> int:
    """Start the frontend and serve until stopped; returns the exit code."""
    log = EventLog("frontend")
    faults = cfg.faults & FRONTEND_FAULTS
    cfg = FrontendConfig(**{**cfg.__dict__, "faults": faults})
    stop = StopSignal(ignore_sigterm="ignore-sigterm" in faults)
    log(f"starting model={cfg.model} faults={','.join(sorted(faults)) or '-'}")
    if "ignore-sigterm" in faults:
        log("ignoring SIGTERM (fault ignore-sigterm)")
    try:
        server = AppServer(cfg.port, FrontendApp(cfg, log), log)
    except OSError as exc:
        log(f"error: cannot listen on 127.0.0.1:{cfg.port}: {exc}")
        return 1
    prefills, decodes = ",".join(u.url for u in cfg.prefills), ",".join(u.url for u in cfg.decodes)
    log(f"ready http=127.0.0.1:{cfg.port} prefill={prefills} decode={decodes} model={cfg.model}")
    serve_until_stopped([server], stop, log)
    log("stopped")
    return 0
