"""The chat client against a real HTTP server on 127.0.0.1 (a stdlib server in a thread, no mocks)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from matrix.check.client import ERROR_KINDS, _SSEParser, build_payload, send_chat
from matrix.check.validate import validate_chat_response
from matrix.launch.launch_plan import RequestSpec

BIG_ID = 15783270017955876104

Route = Callable[["Handler"], None]


class Server(ThreadingHTTPServer):
    """Routes by path; records every request body; `release` lets slow handlers finish at teardown.

    Routes also record what they saw happen, so tests assert the order of events rather than durations:
    `marks` (route's own clock, name -> time.perf_counter() just before sending a part), `answered` (a held
    answer was sent) and `hung_up` (the client closed the connection while the route was still writing).
    """

    def __init__(self, routes: dict[str, Route]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes = routes
        self.received: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.marks: dict[str, float] = {}
        self.answered = threading.Event()
        self.hung_up = threading.Event()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append({"path": self.path, "headers": dict(self.headers), "json": json.loads(body)})
        self.server.routes[self.path](self)

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass

    # Helpers for routes.
    def send_body(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def start_chunked(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def healthy_json() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "tiny",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
            "nvext": {"worker_id": {"prefill_worker_id": BIG_ID, "decode_worker_id": 2**64 - 1}},
        }
    ).encode()


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"


def chunk_obj(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-s",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }


FIRST_TOKEN_DELAY = 0.25
REST_DELAY = 0.2


def route_ok(h: Handler) -> None:
    h.send_body(200, healthy_json())


def route_big(h: Handler) -> None:
    # Close-delimited body far over the cap; the client must stop reading on its own.
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Connection", "close")
    h.end_headers()
    block = b"x" * 65536
    try:
        for _ in range(200):  # 13 MB unless the client hangs up
            h.wfile.write(block)
    except (BrokenPipeError, ConnectionResetError):
        h.server.hung_up.set()
    h.close_connection = True


def route_big_declared(h: Handler) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        h.send_body(200, b"y" * 5_000_000)


def route_stream(h: Handler) -> None:
    h.start_chunked("text/event-stream; charset=utf-8")
    h.chunk(b": keep-alive comment\r\n\r\n")
    h.server.marks["role"] = time.perf_counter()
    h.chunk(sse(chunk_obj({"role": "assistant", "content": ""})))
    time.sleep(FIRST_TOKEN_DELAY)
    first = sse(chunk_obj({"content": "Hello"}))
    h.server.marks["text"] = time.perf_counter()
    # Split an event mid-line and mid-CRLF: the parser must reassemble across network pieces.
    h.chunk(first[:9])
    h.chunk(first[9:-3])
    h.chunk(first[-3:])
    time.sleep(REST_DELAY)
    h.chunk(sse(chunk_obj({"content": ", w\u00f6rld"})) + sse(chunk_obj({"content": "!"}, "length")))
    h.chunk(
        sse(
            {
                "id": "chatcmpl-s",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
                "nvext": {"worker_id": {"prefill_worker_id": BIG_ID, "decode_worker_id": 42}},
            }
        )
    )
    h.server.marks["last"] = time.perf_counter()
    h.chunk(b"data: [DONE]\r\n\r\n")
    h.end_chunked()


def route_stream_no_done(h: Handler) -> None:
    h.start_chunked("text/event-stream")
    h.chunk(sse(chunk_obj({"content": "partial"})))
    h.end_chunked()


def route_stream_error_chunk(h: Handler) -> None:
    h.start_chunked("text/event-stream")
    h.chunk(sse(chunk_obj({"content": "par"})))
    h.chunk(sse({"error": {"message": "decode worker died", "code": 500}}))
    h.chunk(b"data: [DONE]\n\n")
    h.end_chunked()


def route_stream_bad_json(h: Handler) -> None:
    h.start_chunked("text/event-stream")
    h.chunk(b"data: {not json\n\n")
    h.end_chunked()


def route_unavailable(h: Handler) -> None:
    h.send_body(503, b'{"error": "no prefill workers"}')


def route_slow(h: Handler) -> None:
    h.server.release.wait(10)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        h.send_body(200, healthy_json())
    h.server.answered.set()


def route_trickle(h: Handler) -> None:
    # Each read is fast, but the whole answer takes far longer than the budget.
    h.start_chunked("application/json")
    try:
        for _ in range(100):
            if h.server.release.wait(0.05):
                break
            h.chunk(b" ")
        h.end_chunked()
    except (BrokenPipeError, ConnectionResetError):
        h.server.hung_up.set()


def route_cut(h: Handler) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", "1000")
    h.end_headers()
    h.wfile.write(b'{"choices": [')
    h.wfile.flush()
    h.close_connection = True


ROUTES: dict[str, Route] = {
    "/ok": route_ok,
    "/big": route_big,
    "/big-declared": route_big_declared,
    "/stream": route_stream,
    "/stream-no-done": route_stream_no_done,
    "/stream-error": route_stream_error_chunk,
    "/stream-bad-json": route_stream_bad_json,
    "/unavailable": route_unavailable,
    "/slow": route_slow,
    "/trickle": route_trickle,
    "/cut": route_cut,
}


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server(ROUTES)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def spec_for(srv: Server, path: str, **changes: Any) -> RequestSpec:
    host, port = srv.server_address[:2]
    base = RequestSpec(url=f"http://{host!s}:{port}{path}", model="tiny", prompt="Tell me about KV caches.")
    return replace(base, **changes)


def test_build_payload_matches_domain_request() -> None:
    spec = RequestSpec(url="http://h/v1/chat/completions", model="Qwen/Qwen3-0.6B", prompt="long prompt")
    assert build_payload(spec) == {
        "model": "Qwen/Qwen3-0.6B",
        "messages": [{"role": "user", "content": "long prompt"}],
        "max_tokens": 64,
        "n": 1,
        "temperature": 0,
        "stream": False,
        "nvext": {"extra_fields": ["worker_id"]},
    }
    streaming = build_payload(spec, stream=True)
    assert streaming["stream"] is True
    assert streaming["stream_options"] == {"include_usage": True}


def test_plain_json_response(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # A proxy in the environment must be ignored: this one does not exist and would fail the request.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)

    response = send_chat(spec_for(server, "/ok", max_tokens=32))
    assert response.error is None and response.error_kind is None
    assert response.status_code == 200
    assert response.content_type == "application/json"
    assert response.body == healthy_json()
    assert response.ttft_s is None
    assert response.request_s > 0

    sent = server.received[0]
    assert sent["json"]["max_tokens"] == 32
    assert sent["json"]["nvext"] == {"extra_fields": ["worker_id"]}
    assert sent["headers"]["Accept-Encoding"] == "identity"

    validation = validate_chat_response(response.status_code, response.body)
    assert validation.ok, validation.failures
    assert validation.prefill_worker_id == BIG_ID
    assert validation.decode_worker_id == 2**64 - 1


@pytest.mark.parametrize("path", ["/big", "/big-declared"])
def test_oversized_body_is_capped(server: Server, path: str) -> None:
    response = send_chat(spec_for(server, path, max_response_bytes=100_000, timeout_s=10))
    assert response.error_kind == "oversized"
    assert response.error is not None and "100000 bytes" in response.error
    assert response.status_code == 200
    assert len(response.body) == 100_000
    assert set(response.body) <= {ord("x"), ord("y")}
    if path == "/big":  # 13 MB, more than any socket buffer: the route sees the client stop reading and hang up
        assert server.hung_up.wait(10), "the client read on past its cap"


def test_body_exactly_at_cap_is_accepted(server: Server) -> None:
    response = send_chat(spec_for(server, "/ok", max_response_bytes=len(healthy_json())))
    assert response.error is None
    assert response.body == healthy_json()


def test_sse_stream_is_assembled_with_ttft(server: Server) -> None:
    response = send_chat(spec_for(server, "/stream"), stream=True)
    assert response.error is None, response.error
    assert response.status_code == 200
    assert response.content_type == "application/json"
    assert server.received[0]["json"]["stream"] is True

    # TTFT is the first chunk with text, not the role-only opening chunk: the client started before the
    # server sent the opening chunk and got the text after the server sent it, so its TTFT spans at least
    # the server's pause between the two (one taken at the opening chunk would not). The request spans the
    # whole stream, opening chunk to the last, and ends after its first token.
    assert response.ttft_s is not None
    marks = server.marks
    assert response.ttft_s >= marks["text"] - marks["role"]
    assert response.request_s >= marks["last"] - marks["role"]
    assert response.ttft_s <= response.request_s

    document = json.loads(response.body)
    assert document["object"] == "chat.completion"
    assert document["id"] == "chatcmpl-s"
    assert document["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello, w\u00f6rld!"},
            "finish_reason": "length",
        }
    ]
    assert document["usage"]["completion_tokens"] == 3
    assert document["nvext"]["worker_id"]["prefill_worker_id"] == BIG_ID

    validation = validate_chat_response(response.status_code, response.body)
    assert validation.ok, validation.failures
    assert validation.prefill_worker_id == BIG_ID
    assert validation.content == "Hello, w\u00f6rld!"


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("/stream-no-done", "without 'data: [DONE]'"),
        ("/stream-error", "error chunk"),
        ("/stream-bad-json", "data is not JSON"),
    ],
)
def test_broken_stream_is_a_protocol_error_with_raw_body(server: Server, path: str, fragment: str) -> None:
    response = send_chat(spec_for(server, path), stream=True)
    assert response.error_kind == "protocol"
    assert response.error is not None and fragment in response.error
    assert response.content_type.startswith("text/event-stream")
    assert response.body.startswith(b"data: ")


def test_stream_request_answered_with_error_status_keeps_body(server: Server) -> None:
    response = send_chat(spec_for(server, "/unavailable"), stream=True)
    assert response.error is None
    assert response.status_code == 503
    assert response.body == b'{"error": "no prefill workers"}'
    assert response.ttft_s is None
    validation = validate_chat_response(response.status_code, response.body)
    assert [f.name for f in validation.failures] == ["http_status"]


def test_connection_refused() -> None:
    # A bound socket that never listens: the port is ours, so nothing else can answer on it.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        spec = RequestSpec(url=f"http://127.0.0.1:{port}/v1/chat/completions", model="m", prompt="p")
        response = send_chat(spec)
    assert response.error_kind == "connect"
    assert response.status_code is None
    assert response.body == b""
    assert response.error is not None and str(port) in response.error


def test_timeout_waiting_for_response(server: Server) -> None:
    response = send_chat(spec_for(server, "/slow", timeout_s=0.3))
    assert response.error_kind == "timeout"
    assert response.status_code is None
    assert response.error is not None and "timed out after 0.3 s" in response.error
    # It gave up while the server still held its answer (the route waits for the test's teardown).
    assert not server.answered.is_set()


def test_total_budget_stops_a_trickling_body(server: Server) -> None:
    response = send_chat(spec_for(server, "/trickle", timeout_s=0.5))
    assert response.error_kind == "timeout"
    assert response.status_code == 200
    assert response.error is not None and "0.5 s" in response.error
    # The route, trickling for 5 s, sees the client hang up mid-body: it stopped reading, it did not wait.
    assert server.hung_up.wait(10), "the client read the whole trickle"


def test_connection_cut_mid_body_is_a_protocol_error(server: Server) -> None:
    response = send_chat(spec_for(server, "/cut"))
    assert response.error_kind == "protocol"
    assert response.status_code == 200


def test_error_kinds_are_the_documented_ones() -> None:
    assert ERROR_KINDS == ("connect", "timeout", "oversized", "protocol")


def feed_all(pieces: list[bytes]) -> list[tuple[str, str]]:
    parser = _SSEParser()
    events: list[tuple[str, str]] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_sse_parser_line_endings_split_anywhere(newline: bytes) -> None:
    stream = newline.join(
        [b": comment", b"event: update", b"data: a", b"data:b", b"id: 7", b"", b"data: [DONE]", b"", b""]
    )
    expected = [("update", "a\nb"), ("message", "[DONE]")]
    assert feed_all([stream]) == expected
    # Byte by byte, so CRLF and every field are split between pieces.
    assert feed_all([stream[i : i + 1] for i in range(len(stream))]) == expected


def test_sse_parser_dispatches_last_event_without_blank_line() -> None:
    assert feed_all([b"data: {}\n"]) == [("message", "{}")]
    assert feed_all([b"data: {}"]) == [("message", "{}")]
