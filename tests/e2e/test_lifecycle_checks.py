"""[M22] `orphan_decode_released` against a loopback decode that answers headers, then nothing: the check
must drop it after its hold (not after the 60 s request timeout), read the gauges while it is held, and
pass only when the server frees the request once its client is gone."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from matrix.check.lifecycle import ORPHAN_HOLD_S, orphan_decode_released
from matrix.check.specs import EngineGauges, LifecycleSpec, RequestSpec

pytestmark = pytest.mark.e2e


class _SilentDecode:
    """POST: 200 and SSE headers, then silence until the client goes away (or forever, `holds`)."""

    def __init__(self, holds: bool) -> None:
        self.holds = holds
        self.waiting = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        decode = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with decode.lock:
                    waiting = decode.waiting
                text = (f"vllm:num_requests_running 0\nvllm:num_requests_waiting {waiting}\n"
                        f"vllm:kv_cache_usage_perc {0.01 * waiting}\n").encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def do_POST(self) -> None:
                json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with decode.lock:
                    decode.waiting += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.flush()
                # Waiting for KV: nothing to send; a client that left shows as EOF on the socket.
                self.connection.settimeout(30)
                with contextlib.suppress(OSError):
                    self.connection.recv(1)
                if not decode.holds:
                    with decode.lock:
                        decode.waiting -= 1

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=[False, True], ids=["releases", "holds"])
def decode(request: pytest.FixtureRequest) -> Iterator[_SilentDecode]:
    server = _SilentDecode(holds=bool(request.param))
    yield server
    server.close()


def test_a_silent_orphaned_decode_is_dropped_after_the_hold_and_judged(decode: _SilentDecode, tmp_path: Path) -> None:
    spec = LifecycleSpec(str(tmp_path), engines=(EngineGauges("decode", decode.url("/metrics")),),
                         orphan_url=decode.url("/v1/chat/completions"), bound_s=3.0)  # fmt: skip
    request = RequestSpec(decode.url("/v1/chat/completions"), "m", "hi", timeout_s=60.0)
    started = time.monotonic()
    failures = orphan_decode_released(spec, request)
    took = time.monotonic() - started
    evidence = json.loads((tmp_path / "orphan_decode_released.json").read_text())
    assert evidence["during"]["decode"]["waiting"] == 1, evidence  # read while it was held
    assert evidence["ended_by_engine"] is False and "waited silently" in evidence["error"], evidence
    assert took < 60.0  # dropped after its hold, not after the request timeout
    if decode.holds:
        assert [f.name for f in failures] == ["orphan_decode_released"], failures
        assert "1 waiting" in failures[0].message and evidence["after"]["decode"]["waiting"] == 1
    else:
        assert failures == [], failures
        assert evidence["after"]["decode"]["waiting"] == 0 and evidence["released_s"] < 3.0
        assert ORPHAN_HOLD_S <= took < ORPHAN_HOLD_S + 3.0
