"""A real HTTP webhook receiver on 127.0.0.1 in a thread, for the notification tests: it keeps every post it
got (headers and JSON body) and answers as the test says: a status for the next posts, or a delay."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Post:
    status: int  # what the receiver answered
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Receiver:
    url: str
    posts: list[Post] = field(default_factory=list)
    # Statuses for the next posts, in order; once used up, every post gets `status`.
    script: list[int] = field(default_factory=list)
    status: int = 200
    delay_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def accepted(self) -> list[Post]:
        """The posts answered 2xx: what a receiver that dedupes nothing would have shown."""
        with self.lock:
            return [p for p in self.posts if 200 <= p.status < 300]

    def events(self) -> list[tuple[str, str]]:
        """(event, case) of every accepted post, duplicates included."""
        return [(p.body["event"], p.body["case"]) for p in self.accepted]

    def deduped(self) -> list[tuple[str, str]]:
        """What a receiver that honours `Idempotency-Key` shows: each key's first accepted post."""
        seen: dict[str, tuple[str, str]] = {}
        for p in self.accepted:
            seen.setdefault(p.headers["Idempotency-Key"], (p.body["event"], p.body["case"]))
        return list(seen.values())


@contextmanager
def webhook(path: str = "/services/T0/B0/s3cretpath") -> Iterator[Receiver]:
    """A receiver at http://127.0.0.1:PORT`path` for the length of the block."""
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if receiver.delay_s:
                time.sleep(receiver.delay_s)
            with receiver.lock:
                status = receiver.script.pop(0) if receiver.script else receiver.status
                receiver.posts.append(Post(status, dict(self.headers.items()), json.loads(raw or b"{}")))
            answer = b"ok" if status < 300 else b"receiver says no"
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
            except OSError:
                pass  # the client gave up waiting (the slow receiver's point)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = Receiver(url=f"http://127.0.0.1:{server.server_address[1]}{path}")
    thread = threading.Thread(target=server.serve_forever, name="webhook", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
