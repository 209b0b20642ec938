"""[M22] matrix's P/D proxy (`--protocol vllm`) relaying a stream: a real proxy process between two loopback
servers shaped like vLLM's prefill (answers `kv_transfer_params`) and decode (streams SSE chunks slowly)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from matrix.check.client import send_chat
from matrix.check.specs import RequestSpec
from matrix.check.validate import validate_chat_response
from matrix.pdproxy import instance_id
from tests.helpers.ports import free_port

pytestmark = pytest.mark.e2e
CHUNKS = 200


class _VllmPair:
    """Prefill answers one JSON body with `kv_transfer_params`; decode streams CHUNKS chunks, 10 ms apart,
    then usage and [DONE], and records whether its client went away before the end."""

    def __init__(self) -> None:
        self.decode_bodies: list[dict[str, object]] = []
        self.client_gone = threading.Event()
        self.servers = {role: ThreadingHTTPServer(("127.0.0.1", 0), self._handler(role)) for role in ("p", "d")}
        for server in self.servers.values():
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.servers[role].server_address[1]}"

    def _handler(self, role: str) -> type[BaseHTTPRequestHandler]:
        pair = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if role == "p":
                    kv = {"do_remote_prefill": True, "remote_engine_id": "engine-p", "remote_block_ids": [1]}
                    data = json.dumps({"choices": [], "kv_transfer_params": kv}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                pair.decode_bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for i in range(CHUNKS):
                        delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f" w{i}"}
                        chunk = {"id": "x", "object": "chat.completion.chunk", "model": "m",
                                 "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}  # fmt: skip
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                        time.sleep(0.01)
                    usage = {"prompt_tokens": 3, "completion_tokens": CHUNKS - 1, "total_tokens": CHUNKS + 2}
                    end = {"id": "x", "object": "chat.completion.chunk", "model": "m", "usage": usage,
                           "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}  # fmt: skip
                    self.wfile.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pair.client_gone.set()

        return Handler

    def close(self) -> None:
        for server in self.servers.values():
            server.shutdown()
            server.server_close()


@pytest.fixture
def proxied() -> Iterator[tuple[_VllmPair, int]]:
    pair, port = _VllmPair(), free_port()
    argv = [sys.executable, "-m", "matrix.pdproxy", "--port", str(port), "--prefill-url", pair.url("p"),
            "--decode-url", pair.url("d"), "--timeout-s", "10"]  # fmt: skip
    proxy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/live", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield pair, port
    finally:
        proxy.terminate()
        proxy.wait(10)
        pair.close()


def test_a_stream_is_relayed_with_usage_and_worker_ids(proxied: tuple[_VllmPair, int]) -> None:
    pair, port = proxied
    spec = RequestSpec(f"http://127.0.0.1:{port}/v1/chat/completions", "m", "hi", max_tokens=CHUNKS, timeout_s=20)
    response = send_chat(spec, stream=True)
    assert response.error is None, response.error
    validation = validate_chat_response(response.status_code, response.body)
    assert validation.failures == (), validation.failures
    assert validation.completion_tokens == CHUNKS - 1
    assert (validation.prefill_worker_id, validation.decode_worker_id) == (
        instance_id("prefill", pair.url("p"), "engine-p"), instance_id("decode", pair.url("d")))  # fmt: skip
    assert response.ttft_s is not None and response.ttft_s < response.request_s
    decode = pair.decode_bodies[-1]
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
    assert decode["kv_transfer_params"] == {"do_remote_prefill": True, "remote_engine_id": "engine-p",
                                            "remote_block_ids": [1]}  # fmt: skip


def test_a_client_that_drops_the_stream_drops_decodes_stream_too(proxied: tuple[_VllmPair, int]) -> None:
    """What lets an engine behind the proxy abort a cancelled request: the proxy closes decode's connection."""
    pair, port = proxied
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": CHUNKS, "stream": True}
    with (
        httpx.Client(trust_env=False) as client,
        client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=20) as response,
    ):
        assert response.status_code == 200
        for number, _line in enumerate(response.iter_lines()):
            if number >= 6:
                break
    # Decode is still ~1.9 s from its end: it must see its client gone long before that.
    assert pair.client_gone.wait(1.5), "decode's stream was not closed when the client went away"
