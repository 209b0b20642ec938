"""A stand-in engine for supervisor tests: serves /health and /v1/models, and can misbehave on request.

Run as a script: `python fake_engine.py --port N [--delay S] [--no-models] [--ignore-term] [--orphan]
[--ready-file PATH]`. Every option mimics something real engines do to the runner.
"""

from __future__ import annotations

import argparse
import http.server
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The grandchild of --orphan: leaves the session (like an MPI daemon), ignores SIGTERM, lives forever; with
# --orphan-linger S it ends S seconds after the engine is gone instead (like multiprocessing's resource tracker
# of an engine run in a group of its own, which cleans up after it). It keeps the engine's stdout, as such
# children do, and touches argv[1] once it is up.
ORPHAN_CODE = (
    "import os, pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "parent = os.getppid()\n"
    "print('orphan up', flush=True)\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "linger = float(sys.argv[2])\n"
    "if linger < 0:\n"
    "    time.sleep(3600)\n"
    "while os.getppid() == parent:\n"
    "    time.sleep(0.02)\n"
    "time.sleep(linger)\n"
)


def make_handler(models: list[dict[str, str]]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self.answer(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self.answer(200, {"object": "list", "data": models})
            else:
                self.answer(404, {"error": "not found"})

        def answer(self, status: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def spawn_orphan(linger_s: float) -> None:
    """Start the orphan and wait until it runs, so a test never races its start-up."""
    with tempfile.TemporaryDirectory() as scratch:
        marker = Path(scratch) / "up"
        argv = [sys.executable, "-c", ORPHAN_CODE, str(marker), str(linger_s)]
        orphan = subprocess.Popen(argv, start_new_session=True)
        while not marker.exists():
            time.sleep(0.005)
    print(f"orphan pid {orphan.pid}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to 'load weights' before listening")
    parser.add_argument("--no-models", action="store_true", help="answer /v1/models with an empty list")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--orphan", action="store_true", help="spawn a setsid grandchild ignoring SIGTERM")
    parser.add_argument("--orphan-linger", type=float, default=-1.0, help="the orphan ends S s after the engine")
    parser.add_argument("--ready-file", help="write the wall-clock time at which the port listens")
    args = parser.parse_args()

    if args.ignore_term:
        # Ignored, but said: a test sees that SIGTERM came (and was outlived) before the SIGKILL.
        signal.signal(signal.SIGTERM, lambda _sig, _frame: print("ignoring SIGTERM", flush=True))
    if args.orphan:
        spawn_orphan(args.orphan_linger)
    print("loading weights", flush=True)
    time.sleep(args.delay)
    models = [] if args.no_models else [{"id": "fake-model", "object": "model"}]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(models))
    if args.ready_file:
        Path(args.ready_file).write_text(repr(time.time()))
    print(f"listening on {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
