"""[M22] `orphan_decode_released` against a loopback decode that answers headers, then nothing: the check
must drop it after its hold (not after the 60 s request timeout), read the gauges while it is held, and
pass only when the server frees the request once its client is gone. `cancel_recovers` against a loopback
engine that finishes whole answers before the client reads the gauges (what a loaded machine makes of a
fast engine): such a drop cancelled nothing, so the check must try again and never pass on it alone."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from matrix.check.lifecycle import CANCEL_ATTEMPTS, ORPHAN_HOLD_S, cancel_recovers, orphan_decode_released
from matrix.check.specs import EngineGauges, LifecycleSpec, RequestSpec

pytestmark = pytest.mark.e2e


class _LoopbackServer:
    """A threaded HTTP server on a free loopback port, serving `_handler()` until `close()`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _SilentDecode(_LoopbackServer):
    """POST: 200 and SSE headers, then silence until the client goes away (or forever, `holds`)."""

    def __init__(self, holds: bool) -> None:
        self.holds = holds
        self.waiting = 0
        super().__init__()

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


# A chat answer the validation passes: several tokens, served by two distinct workers.
ANSWER = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "one two three four"},
                       "finish_reason": "length"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
          "nvext": {"worker_id": {"prefill_worker_id": 1, "decode_worker_id": 2}}}  # fmt: skip


class _FastEngine(_LoopbackServer):
    """Streams: the first `finishes` are generated whole (running back to 0) before the client can read the
    gauges, in `whole_chunks` text chunks and [DONE] (vLLM's API server sends what piled up while it waited for
    the CPU as one chunk); later ones stay running until their client goes away. Non-streaming: `ANSWER`."""

    def __init__(self, finishes: int, whole_chunks: int = 8) -> None:
        self.finishes = finishes
        self.whole_chunks = whole_chunks
        self.streams = 0
        self.running = 0
        super().__init__()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                with engine.lock:
                    running = engine.running
                text = f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
                self._send(text.encode(), "text/plain")

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not payload.get("stream"):
                    self._send(json.dumps(ANSWER).encode(), "application/json")
                    return
                chunk = b'data: {"choices": [{"delta": {"content": " ga"}}]}\n\n'
                with engine.lock:
                    engine.streams += 1
                    finished = engine.streams <= engine.finishes
                    engine.running += 0 if finished else 1
                # The whole answer was generated before the client reads it: only the transfer is left.
                whole = chunk * engine.whole_chunks + b"data: [DONE]\n\n"
                self._send(whole if finished else chunk * 4, "text/event-stream")
                if finished:
                    return
                self.connection.settimeout(30)
                with contextlib.suppress(OSError):
                    self.connection.recv(1)  # EOF: the client dropped the stream
                with engine.lock:
                    engine.running -= 1

        return Handler


@pytest.mark.parametrize("whole_chunks", [8, 2], ids=["read-before-done", "done-within-the-chunks-read"])
@pytest.mark.parametrize("finishes", [CANCEL_ATTEMPTS - 1, CANCEL_ATTEMPTS])
def test_a_dropped_stream_the_engine_had_already_finished_is_tried_again(
    finishes: int, whole_chunks: int, tmp_path: Path
) -> None:
    """Whether the client saw [DONE] before it would drop (2 chunks, fewer than the 3 it reads) or not, a stream
    the engine had finished is no cancel: tried again, dropped at its first chunk, and skipped if no attempt
    caught one in flight; the evidence tells each stream."""
    engine = _FastEngine(finishes, whole_chunks)
    try:
        spec = LifecycleSpec(str(tmp_path), engines=(EngineGauges("decode", engine.url("/metrics")),), bound_s=3.0)
        request = RequestSpec(engine.url("/v1/chat/completions"), "m", "hi", timeout_s=30.0)
        failures = cancel_recovers(spec, request, ())
    finally:
        engine.close()
    evidence = json.loads((tmp_path / "cancel_recovers.json").read_text())
    assert evidence["attempts"] == min(finishes + 1, CANCEL_ATTEMPTS) == engine.streams, evidence
    streams = evidence["streams"]
    assert len(streams) == engine.streams, streams
    # The first stream is read for three chunks (and ends whole if the engine sent fewer); every later one is
    # dropped at its first chunk, before any [DONE].
    assert streams[0]["chunks_read"] == min(whole_chunks, 3), streams
    assert streams[0]["ended_whole"] is (whole_chunks < 3), streams
    assert all(s["chunks_read"] == 1 and not s["ended_whole"] for s in streams[1:]), streams
    assert [s["in_flight_during"] for s in streams] == [0] * finishes + [1] * (len(streams) - finishes), streams
    assert evidence["stream_ended_before_drop"] is False, evidence
    if finishes < CANCEL_ATTEMPTS:
        assert failures == [], failures
        assert evidence["in_flight_during"] == 1 and evidence["after"]["decode"]["running"] == 0, evidence
        assert evidence["recovery"]["failed_checks"] == [], evidence
    else:  # never exercised: neither a pass nor the engine's failure, and the evidence says why
        assert failures == [] and evidence["passed"] is None, (failures, evidence)
        assert f"in {CANCEL_ATTEMPTS} attempts" in evidence["skipped"] and "cancel nothing" in evidence["skipped"]
        assert evidence["in_flight_during"] == 0 and "recovery" not in evidence, evidence
