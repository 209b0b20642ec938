"""Small shared pieces for the three servers: JSON handlers, errors, start-up and signal handling."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socketserver
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, Protocol

JSON_TYPE = "application/json"


class HTTPError(Exception):
    """Raised by a route to answer with an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """The JSON error shape every process answers with (OpenAI's)."""
    return {"error": {"message": message, "type": kind, "code": status}}


Route = Callable[["JSONHandler"], None]


class App(Protocol):
    """What a server hosts: a route table keyed by (method, path)."""

    def routes(self) -> dict[tuple[str, str], Route]: ...


class AppServer(ThreadingHTTPServer):
    """A threaded HTTP server on 127.0.0.1 that knows its app and its event log."""

    daemon_threads = True
    # Do not wait for in-flight requests on close: shutdown must be quick.
    block_on_close = False
    # socketserver's default listen backlog is 5: a burst of concurrent clients (the traffic check's streams)
    # overflows it, and each dropped SYN costs a client its 1 s retransmit, which would pose as TTFT.
    request_queue_size = 128

    def __init__(self, port: int, app: App, log: Callable[[str], None]) -> None:
        self.app = app
        self.log = log
        self.table = app.routes()
        super().__init__(("127.0.0.1", port), JSONHandler)


class JSONHandler(BaseHTTPRequestHandler):
    """Dispatches to the app's routes and turns exceptions into JSON errors."""

    server: AppServer
    # HTTP/1.0: one request per connection and a body may end at close, which keeps streaming simple.
    protocol_version = "HTTP/1.0"
    server_version = "matrix-reference/0.1"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    @property
    def route_path(self) -> str:
        return self.path.split("?", 1)[0]

    def _dispatch(self, method: str) -> None:
        route = self.server.table.get((method, self.route_path))
        try:
            if route is None:
                known = {p for _m, p in self.server.table}
                if self.route_path in known:
                    raise HTTPError(405, f"method {method} not allowed on {self.route_path}")
                raise HTTPError(404, f"no route {method} {self.route_path}", "not_found_error")
            route(self)
        except HTTPError as exc:
            self.send_json(exc.status, error_body(exc.status, exc.message, exc.kind))
        except (BrokenPipeError, ConnectionResetError):
            self.server.log(f"client went away during {method} {self.route_path}")
        except Exception as exc:
            # A bug; answer 500 so the caller sees it, and log it on one line.
            self.server.log(f"internal error on {method} {self.route_path}: {type(exc).__name__}: {exc}")
            with contextlib.suppress(OSError):
                self.send_json(500, error_body(500, f"{type(exc).__name__}: {exc}", "internal_error"))

    def read_json(self, max_bytes: int = 1 << 20) -> Any:
        """The request body as JSON; 413 when too large, 400 when not JSON."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError as exc:
            raise HTTPError(400, "invalid Content-Length header") from exc
        if length > max_bytes:
            raise HTTPError(413, f"request body is {length} bytes, the limit is {max_bytes}")
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HTTPError(400, f"request body is not valid JSON: {exc}") from exc

    def read_json_object(self, max_bytes: int = 1 << 20) -> dict[str, Any]:
        body = self.read_json(max_bytes)
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    def send_bytes(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, obj: Any) -> None:
        self.send_bytes(status, json.dumps(obj).encode("utf-8"), JSON_TYPE)

    def log_message(self, format: str, *args: Any) -> None:
        self.server.log(f"http {self.address_string()} {format % args}")


class StopSignal:
    """SIGTERM/SIGINT wake the main thread through a self-pipe (async-signal-safe, unlike Event.set)."""

    def __init__(self, ignore_sigterm: bool) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self.signum: int | None = None
        # SIG_IGN is inherited across exec, like an engine that masks SIGTERM for its whole tree.
        signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_sigterm else self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signum
        # A full pipe already holds a wake-up; nothing is lost by dropping this one.
        with contextlib.suppress(BlockingIOError):
            os.write(self._write_fd, b"\0")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop signal (True) or until `timeout` seconds pass (False)."""
        ready, _w, _x = select.select([self._read_fd], [], [], timeout)
        return bool(ready)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "?"


def serve_until_stopped(
    servers: Iterable[socketserver.BaseServer], stop: StopSignal, log: Callable[[str], None]
) -> None:
    """Serve each server on a daemon thread until a stop signal, then shut them all down together."""
    servers = list(servers)
    for srv in servers:
        # A short poll interval bounds how long shutdown() waits for the serving loop.
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    stop.wait()
    log(f"received {stop.name}, shutting down")
    stoppers = [threading.Thread(target=srv.shutdown) for srv in servers]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    for srv in servers:
        srv.server_close()
