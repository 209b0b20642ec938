"""[M27] peer loss through matrix's P/D proxy (`--protocol vllm`): a real proxy process in front of small loopback
servers shaped like vLLM's prefill and decode, where the decode dies mid-answer or an instance is not there at
all. The proxy must answer at once with an error, never hang and never hand over a cut stream as if whole:

* a decode killed mid-stream (its connection reset, or its chunked body left unfinished, or a plain body that
  closes before `[DONE]`): the client gets the chunks decode sent, then an error event naming the decode and
  what cut it, then `[DONE]`; the proxy's log says it (`chat stream cut by decode`);
* a prefill or decode nothing listens on (the process is gone): HTTP 503 naming the instance, streamed or not;
  with decode gone, the log names the prefill request whose KV was made and left unclaimed.

Before the proxy knew a cut stream, the client's stream just stopped: no error, no `[DONE]`. A reset was logged as
"client went away" (decode's reset taken for the client's), and an unfinished chunked body or a plain body closed
early was logged as a whole stream ("chat stream ... events=2").
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.ports import free_port

pytestmark = pytest.mark.e2e

# How a decode's stream ends: whole, or cut after two chunks as a killed process cuts it.
ENDINGS = ("whole", "reset", "unfinished_chunks", "closed_before_done")
# The client's own bound: a proxy that waits on a dead peer fails the test with a timeout, not a hang.
CLIENT_TIMEOUT_S = 15.0


class _Instance:
    """A fake vLLM instance: a prefill answers `kv_transfer_params`; a decode streams two chunks and then ends
    as `ending` says."""

    def __init__(self, role: str, ending: str = "whole") -> None:
        self.role, self.ending = role, ending
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        me = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if me.role == "prefill":
                    kv = {"do_remote_prefill": True, "remote_engine_id": "engine-p", "remote_block_ids": [1],
                          "remote_request_id": "chatcmpl-p1"}  # fmt: skip
                    data = json.dumps({"choices": [], "kv_transfer_params": kv}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                assert body.get("stream"), body
                self.close_connection = True
                chunked = me.ending != "closed_before_done"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for k in range(2):
                    event = {"choices": [{"index": 0, "delta": {"content": f" t{k}"}, "finish_reason": None}]}
                    self._write(b"data: " + json.dumps(event).encode() + b"\n\n", chunked)
                if me.ending == "whole":
                    self._write(b"data: [DONE]\n\n", chunked)
                    self.wfile.write(b"0\r\n\r\n")
                elif me.ending == "reset":  # SO_LINGER 0: close() sends RST, as the kernel does for a killed process
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                else:  # "unfinished_chunks" / "closed_before_done": the socket closes with no end of body
                    self.connection.shutdown(socket.SHUT_RDWR)

            def _write(self, data: bytes, chunked: bool) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                self.wfile.flush()

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Proxy:
    def __init__(self, prefill_url: str, decode_url: str, log: Path) -> None:
        self.port, self.log = free_port(), log
        argv = [sys.executable, "-m", "matrix.pdproxy", "--port", str(self.port), "--timeout-s", "60",
                "--prefill-url", prefill_url, "--decode-url", decode_url]  # fmt: skip
        with log.open("wb") as sink:
            self.process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/live", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise AssertionError(f"the proxy never came up: {log.read_text()}")

    def chat(self, stream: bool) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}
        return httpx.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def deployment(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[_Proxy, _Instance]]:
    prefill, decode = _Instance("prefill"), _Instance("decode", request.param)
    proxy = _Proxy(prefill.url, decode.url, tmp_path / "proxy.log")
    try:
        yield proxy, decode
    finally:
        proxy.close()
        prefill.close()
        decode.close()


def _events(text: str) -> list[Any]:
    return [line[5:].strip() if line[5:].strip() == "[DONE]" else json.loads(line[5:])
            for line in text.splitlines() if line.startswith("data:")]  # fmt: skip


@pytest.mark.parametrize("deployment", ENDINGS, indirect=True)
def test_a_stream_decode_cuts_ends_with_an_error_event_then_done(deployment: tuple[_Proxy, _Instance]) -> None:
    proxy, decode = deployment
    response = proxy.chat(stream=True)
    assert response.status_code == 200
    # Every line of the body is an SSE line: no HTTP status line of an error answer written mid-stream.
    assert all(not line or line.startswith("data:") for line in response.text.splitlines()), response.text
    events = _events(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events
    tokens = [c["delta"]["content"] for e in events[:-1] if isinstance(e, dict) for c in e.get("choices", [])]
    assert tokens == [" t0", " t1"]  # what decode sent before it died is relayed, nothing more
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    log = proxy.log.read_text()
    if decode.ending == "whole":
        assert errors == [] and "cut by" not in log
        return
    assert len(errors) == 1 and errors[0]["code"] == 503, events
    assert f"decode instance at {decode.url} ended the stream before the answer was complete" in errors[0]["message"]
    assert events[-2] == {"error": errors[0]}  # the error comes last, right before [DONE]
    _wait_for(proxy.log, "chat stream cut by decode after 2 events")
    assert "client went away" not in proxy.log.read_text()  # decode's reset is not mistaken for the client's


def _wait_for(log: Path, text: str) -> None:
    deadline = time.monotonic() + 10
    while text not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in log.read_text(), log.read_text()


@pytest.mark.parametrize("dead", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_instance_nothing_listens_on_is_answered_503_at_once(tmp_path: Path, dead: str, stream: bool) -> None:
    """The process of one role is gone (its port refuses connections): the proxy answers 503 naming it."""
    alive = _Instance("decode" if dead == "prefill" else "prefill")
    gone = f"http://127.0.0.1:{free_port()}"
    urls = (gone, alive.url) if dead == "prefill" else (alive.url, gone)
    proxy = _Proxy(*urls, tmp_path / "proxy.log")
    try:
        response = proxy.chat(stream=stream)
    finally:
        proxy.close()
        alive.close()
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert f"{dead} " in message and gone in message and "unreachable" in message, message
    log = (tmp_path / "proxy.log").read_text()
    # A dead decode leaves the prefill's KV unclaimed: the log names the prefill's request, as its engine does.
    unclaimed = "decode failed (HTTP 503): prefill's KV of request chatcmpl-p1 (1 blocks, engine engine-p) left"
    assert (unclaimed in log) == (dead == "decode"), log
