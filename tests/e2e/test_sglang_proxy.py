"""The SGLang P/D proxy (`matrix.pdproxy --protocol sglang`) as a real process between two loopback servers."""

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

from matrix.pdproxy import instance_id
from tests.helpers.ports import free_port

pytestmark = pytest.mark.e2e


class _Pair:
    """Two loopback servers that behave like an SGLang P/D pair: each half of a request waits until the
    other half of the same bootstrap room has arrived (as SGLang's prefill waits for decode's slots)."""

    def __init__(self, wait_s: float = 5.0) -> None:
        self.arrived: dict[tuple[str, int], threading.Event] = {}
        self.bodies: dict[str, dict[str, object]] = {}
        self.lock = threading.Lock()
        self.wait_s = wait_s
        self.servers = {role: ThreadingHTTPServer(("127.0.0.1", 0), self._handler(role)) for role in ("p", "d")}
        for server in self.servers.values():
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def event(self, role: str, room: int) -> threading.Event:
        with self.lock:
            return self.arrived.setdefault((role, room), threading.Event())

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.servers[role].server_address[1]}"

    def _handler(self, role: str) -> type[BaseHTTPRequestHandler]:
        pair = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                pair.bodies[role] = body
                room = int(body["bootstrap_room"])
                pair.event(role, room).set()
                other = "d" if role == "p" else "p"
                paired = pair.event(other, room).wait(pair.wait_s)
                answer: dict[str, object] = {"choices": [{"message": {"content": "" if role == "p" else "two words"}}]}
                status = 200 if paired else 500
                if not paired:
                    answer = {"error": {"message": f"{role}: no peer for room {room}"}}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def close(self) -> None:
        for server in self.servers.values():
            server.shutdown()
            server.server_close()


@pytest.fixture
def proxied_pair() -> Iterator[tuple[_Pair, int]]:
    pair, port = _Pair(), free_port()
    argv = [sys.executable, "-m", "matrix.pdproxy", "--port", str(port), "--prefill-url", pair.url("p"),
            "--decode-url", pair.url("d"), "--protocol", "sglang", "--bootstrap-port", "4321",
            "--timeout-s", "10"]  # fmt: skip
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


def test_proxy_sends_both_halves_at_once_and_answers_with_decode(proxied_pair: tuple[_Pair, int]) -> None:
    pair, port = proxied_pair
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=15)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["message"]["content"] == "two words"  # decode's answer, not prefill's
    ids = answer["nvext"]["worker_id"]
    assert ids == {"prefill_worker_id": instance_id("prefill", pair.url("p")),
                   "decode_worker_id": instance_id("decode", pair.url("d"))}  # fmt: skip
    prefill, decode = pair.bodies["p"], pair.bodies["d"]
    assert prefill["bootstrap_room"] == decode["bootstrap_room"]  # one room pairs the halves
    assert prefill["bootstrap_port"] == 4321 and prefill["bootstrap_host"] == "127.0.0.1"
    assert 0 <= int(prefill["bootstrap_room"]) < 2**63
    # A second request gets a fresh room.
    httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=15)
    assert pair.bodies["p"]["bootstrap_room"] != prefill["bootstrap_room"]


def test_proxy_reports_a_half_that_failed(proxied_pair: tuple[_Pair, int]) -> None:
    pair, port = proxied_pair
    pair.wait_s = 0.2
    pair.event("d", 1)  # nothing special: decode simply never gets a peer when prefill is made to fail
    pair.servers["p"].shutdown()
    pair.servers["p"].server_close()
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m", "messages": []},
                          timeout=15)  # fmt: skip
    assert response.status_code >= 500
    assert "prefill" in response.text
