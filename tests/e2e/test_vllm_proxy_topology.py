"""[M27] xPyD through matrix's P/D proxy (`--protocol vllm`, repeated `--prefill-url`/`--decode-url`): a real proxy
process in front of small loopback servers shaped like vLLM's prefill (answers `kv_transfer_params` naming its
engine) and decode (answers a completion; its `/metrics` counts a NIXL transfer per request it served with a KV
handle, unless told to recompute). The routing, the record of each request's pair, and `check.topology`'s
verdicts on them."""

from __future__ import annotations

import json
import re
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

from matrix.check import topology
from matrix.check.specs import TopologySpec, TopologyWorker
from matrix.launch.arms.vllm_native import DECODE_COUNTERS
from matrix.pdproxy import instance_id
from tests.helpers.ports import free_port

pytestmark = pytest.mark.e2e


class _Instance:
    """One fake vLLM instance: a prefill names its engine in `kv_transfer_params`; a decode records the KV
    handles it was given and counts a transfer for each, unless `recompute` (a decode that ignores the handle)."""

    def __init__(self, name: str, recompute: bool = False) -> None:
        self.name, self.recompute = name, recompute
        self.handles: list[dict[str, Any]] = []
        self.transfers = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        me = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, data: bytes, kind: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    count = f'{DECODE_COUNTERS[0]}{{engine="0"}} {me.transfers}.0\n'
                    size = f'{DECODE_COUNTERS[1]}{{engine="0"}} {me.transfers * 4096}.0\n'
                    self._send((count + size).encode(), "text/plain")
                else:
                    self._send(b"")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if me.name.startswith("prefill"):
                    kv = {"do_remote_prefill": True, "remote_engine_id": f"engine-{me.name}", "remote_block_ids": [1]}
                    self._send(json.dumps({"choices": [], "kv_transfer_params": kv}).encode())
                    return
                with me.lock:
                    me.handles.append(body["kv_transfer_params"])
                    me.transfers += 0 if me.recompute else 1
                n = int(body.get("n") or 1)
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    chunk = {"object": "text_completion", "choices": [{"index": 0, "text": " x", "logprobs": None,
                                                                       "finish_reason": "length"}]}  # fmt: skip
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
                    return
                choices = [{"index": k, "text": " x", "logprobs": None, "finish_reason": "length"} for k in range(n)]
                self._send(json.dumps({"object": "text_completion", "choices": choices}).encode())

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Topology:
    def __init__(self, prefills: int, decodes: int, recompute: str, log: Path) -> None:
        self.workers = [_Instance("prefill" if i == 1 else f"prefill_{i}") for i in range(1, prefills + 1)]
        self.workers += [_Instance("decode" if i == 1 else f"decode_{i}", recompute == f"decode_{i}" or
                                   (recompute == "decode" and i == 1)) for i in range(1, decodes + 1)]  # fmt: skip
        self.port, self.log = free_port(), log
        argv = [sys.executable, "-m", "matrix.pdproxy", "--port", str(self.port), "--timeout-s", "10", "--worker-ids"]
        for w in self.workers:
            argv += [f"--{w.name.split('_')[0]}-url", w.url]
        with log.open("wb") as sink:
            self.proxy = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/live", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)

    def by_name(self, name: str) -> _Instance:
        return next(w for w in self.workers if w.name == name)

    def spec(self, record_dir: Path) -> TopologySpec:
        proxy = f"http://127.0.0.1:{self.port}/workers"
        workers = tuple(
            TopologyWorker(w.name, w.name.split("_")[0], f"{proxy}/{w.name}/health", f"{w.url}/metrics")
            for w in self.workers
        )
        return TopologySpec("xpyd", workers, str(record_dir), decode_counters=DECODE_COUNTERS)

    def ask(self, count: int, stream: bool = False) -> list[dict[str, Any]]:
        """`count` completions through the proxy, one after another: each answer's `nvext.worker_ids`."""
        found = []
        for _ in range(count):
            body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream}
            response = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=10)
            assert response.status_code == 200, response.text
            documents = ([json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")] if stream else [response.json()])  # fmt: skip
            found += [w for d in documents for w in (d.get("nvext") or {}).get("worker_ids", [])]
        return found

    def close(self) -> None:
        self.proxy.terminate()
        self.proxy.wait(10)
        for w in self.workers:
            w.close()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    made: list[_Topology] = []

    def start(prefills: int, decodes: int, recompute: str = "") -> _Topology:
        made.append(_Topology(prefills, decodes, recompute, tmp_path / f"proxy-{len(made)}.log"))
        return made[-1]

    yield start
    for t in made:
        t.close()


def _ids(t: _Topology, pairs: list[tuple[str, str]]) -> list[tuple[int, int]]:
    return [(instance_id("prefill", t.by_name(p).url), instance_id("decode", t.by_name(d).url)) for p, d in pairs]


def test_2p2d_round_robin_uses_every_pair_and_names_it_per_choice(make: Any) -> None:
    t = make(2, 2)
    seen = t.ask(4)
    order = [("prefill", "decode"), ("prefill_2", "decode"), ("prefill", "decode_2"), ("prefill_2", "decode_2")]
    assert [(w["prefill_worker_id"], w["decode_worker_id"]) for w in seen] == _ids(t, order)
    # Each decode got the KV handles of the prefills the answers name, in that order.
    assert [h["remote_engine_id"] for h in t.by_name("decode").handles] == ["engine-prefill", "engine-prefill_2"]
    assert [h["remote_engine_id"] for h in t.by_name("decode_2").handles] == ["engine-prefill", "engine-prefill_2"]
    # A streamed answer names its pair too (the fifth request: the first pair again).
    assert [(w["prefill_worker_id"], w["decode_worker_id"]) for w in t.ask(1, stream=True)] == _ids(t, order[:1])
    # Each request's pair is in the proxy's own log.
    logged = re.findall(r" chat (?:stream )?prefill=(\S+) decode=(\S+)", t.log.read_text())
    assert logged == [*order, order[0]]


def test_each_instance_names_its_id_on_the_proxy(make: Any) -> None:
    t = make(1, 2)
    for w in t.workers:
        answer = httpx.get(f"http://127.0.0.1:{t.port}/workers/{w.name}/health", timeout=5).json()
        assert answer["instance_id"] == instance_id(w.name.split("_")[0], w.url)
    t.by_name("decode_2").close()
    assert httpx.get(f"http://127.0.0.1:{t.port}/workers/decode_2/health", timeout=5).status_code == 503
    t.workers.remove(t.by_name("decode_2"))


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_topology_check_passes_when_every_worker_served_and_every_decode_pulled(
    make: Any, tmp_path: Path, shape: tuple[int, int]
) -> None:
    t = make(*shape)
    spec = t.spec(tmp_path)
    before = topology.look(spec)
    failures, record = topology.judge(spec, before, topology.served_pairs(t.ask(4)), traffic=True)
    assert failures == [], failures
    assert all(w["served"] >= 2 for w in record["workers"] if w["role"] == "decode" or shape[0] == 2)
    assert [row["choices"] for row in record["pairs"]] == [2, 2]
    assert json.loads((tmp_path / "topology.json").read_text())["choices"] == 4


def test_a_decode_that_recomputes_fails_the_pairs_ledger(make: Any, tmp_path: Path) -> None:
    t = make(2, 1, recompute="decode")
    spec = t.spec(tmp_path)
    before = topology.look(spec)
    failures, _ = topology.judge(spec, before, topology.served_pairs(t.ask(4)), traffic=True)
    assert [f.name for f in failures] == [topology.PAIR_KV]
    assert "decode decode: 0 KV transfer(s) for 4 choice(s)" in failures[0].message


def test_a_worker_the_load_never_reached_is_unused(make: Any, tmp_path: Path) -> None:
    t = make(1, 2)
    spec = t.spec(tmp_path)
    before = topology.look(spec)
    failures, _ = topology.judge(spec, before, topology.served_pairs(t.ask(1)), traffic=True)
    assert [f.name for f in failures] == [topology.WORKER_UNUSED]
    assert "decode worker decode_2" in failures[0].message
