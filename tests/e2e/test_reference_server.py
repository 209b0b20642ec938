"""End-to-end tests of the reference disaggregated server: three real processes on 127.0.0.1.

Every process runs in its own session and is SIGKILLed by the fixture, whatever the test did. Readiness
is polled every 10 ms; no test sleeps for a fixed time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from matrix.reference import tokens
from matrix.reference.faults import (
    AGGREGATED_FAULTS,
    DECODE_FAULTS,
    FAULT_DESCRIPTIONS,
    FAULTS,
    FAULTS_ENV,
    FRONTEND_FAULTS,
    PREFILL_FAULTS,
)
from matrix.reference.kvpool import CpuStorage, KVPool, PoolFullError, checksum
from tests.helpers.ports import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = "reference-model"
PROMPT = "Explain, in a few words, why prefill and decode run on separate workers."
POLL_S = 0.01
START_TIMEOUT_S = 10.0


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(POLL_S)


@dataclass
class Proc:
    role: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Pair:
    prefill: Proc
    decode: Proc
    frontend: Proc
    url: str
    worker_urls: dict[str, str]
    side_ports: dict[str, int] = field(default_factory=dict)

    @property
    def procs(self) -> list[Proc]:
        return [self.prefill, self.decode, self.frontend]

    def chat(self, max_tokens: int = 16, prompt: str = PROMPT, **extra: Any) -> httpx.Response:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "n": 1,
            "temperature": 0,
            "stream": False,
            "nvext": {"extra_fields": ["worker_id"]},
            **extra,
        }
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=10)


class Launcher:
    """Starts reference processes and remembers them (and any escaped pids) for cleanup."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[Proc] = []
        self.stray_pids: list[int] = []

    def spawn(self, role: str, args: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        log_path = self.tmp_path / f"{role}-{len(self.procs)}.log"
        full_env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
        full_env.update(env or {})
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "matrix.reference", *args],
                cwd=ROOT,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        proc = Proc(role, popen, log_path)
        self.procs.append(proc)
        return proc

    def worker(
        self,
        role: str,
        port: int | None = None,
        side_port: int | None = None,
        kv_cache_bytes: int = 1 << 20,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> tuple[Proc, int, int]:
        port = port or free_port()
        side_port = side_port or free_port()
        args = ["worker", "--role", role, "--port", str(port), "--side-channel-port", str(side_port)]
        args += ["--kv-cache-bytes", str(kv_cache_bytes), *extra]
        return self.spawn(role, args, env), port, side_port

    def pair(
        self,
        faults: Sequence[str] = (),
        env_faults: str | None = None,
        kv_cache_bytes: int = 1 << 20,
        worker_extra: Sequence[str] = (),
        frontend_extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> Pair:
        env = dict(env or {})
        if env_faults is not None:
            env[FAULTS_ENV] = env_faults
        fault_args = [a for f in faults for a in ("--fault", f)]
        prefill, pport, pside = self.worker(
            "prefill", kv_cache_bytes=kv_cache_bytes, extra=[*fault_args, *worker_extra], env=env
        )
        decode, dport, dside = self.worker(
            "decode", kv_cache_bytes=kv_cache_bytes, extra=[*fault_args, *worker_extra], env=env
        )
        fport = free_port()
        worker_urls = {"prefill": f"http://127.0.0.1:{pport}", "decode": f"http://127.0.0.1:{dport}"}
        args = ["frontend", "--port", str(fport), "--prefill-url", worker_urls["prefill"]]
        args += ["--decode-url", worker_urls["decode"], "--model", MODEL, *fault_args, *frontend_extra]
        frontend = self.spawn("frontend", args, env)
        pair = Pair(prefill, decode, frontend, f"http://127.0.0.1:{fport}", worker_urls)
        pair.side_ports = {"prefill": pside, "decode": dside}
        if wait:
            wait_healthy(pair.url, pair.procs)
        return pair

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)
        for pid in self.stray_pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
            # Not our child, so we cannot reap it; dead (a zombie until init reaps it) is enough.
            wait_for(functools.partial(_dead, pid), f"pid {pid} to die")


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def get_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.TransportError:
        return None


def wait_healthy(url: str, procs: Sequence[Proc], timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll `url`/health every 10 ms; fail at once, with the logs, if a process exits."""

    def ready() -> bool:
        for proc in procs:
            if proc.popen.poll() is not None:
                raise AssertionError(f"{proc.role} exited with {proc.popen.returncode}:\n{proc.log()}")
        return get_status(f"{url}/health") == 200

    wait_for(ready, f"{url}/health", timeout_s)


def wait_log(proc: Proc, text: str) -> None:
    wait_for(lambda: text in proc.log(), f"{text!r} in {proc.role}'s log")


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    try:
        yield launcher
    finally:
        launcher.cleanup()


def check_dynamo_shape(data: dict[str, Any], max_tokens: int) -> None:
    """The checks of `matrix.check.validate`, written out independently."""
    assert data["object"] == "chat.completion"
    assert data["model"] == MODEL
    assert len(data["choices"]) == 1
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"].strip()
    assert choice["finish_reason"] == "length"
    usage = data["usage"]
    assert isinstance(usage["prompt_tokens"], int) and usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] == max_tokens > 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    ids = data["nvext"]["worker_id"]
    pid, did = ids["prefill_worker_id"], ids["decode_worker_id"]
    assert type(pid) is int and type(did) is int
    assert 0 <= pid < 2**64 and 0 <= did < 2**64
    assert pid != did


# ---------------------------------------------------------------------------------------------------
# In-process checks of the pure parts


def test_fault_table_is_consistent() -> None:
    assert frozenset(FAULT_DESCRIPTIONS) == FAULTS
    assert len(FAULTS) == 35
    assert all(desc.strip() for desc in FAULT_DESCRIPTIONS.values())
    # Every fault is acted on by at least one process.
    assert FAULTS == PREFILL_FAULTS | DECODE_FAULTS | FRONTEND_FAULTS
    # The aggregated worker acts only on start-up faults and ignore-sigterm: it has no KV transfer to break.
    assert AGGREGATED_FAULTS <= PREFILL_FAULTS & DECODE_FAULTS


def test_tokeniser_and_generation_are_deterministic() -> None:
    ids = tokens.tokenize(PROMPT)
    assert ids == tokens.tokenize(PROMPT)
    assert len(ids) == 16  # 13 words, two commas and a full stop
    assert all(0 <= t < tokens.VOCAB_SIZE for t in ids)
    block = tokens.block_content(ids[-1], len(ids) - 1, 64)
    assert len(block) == 64 and block == tokens.block_content(ids[-1], len(ids) - 1, 64)
    assert tokens.generate(block, 5) == tokens.generate(block, 5)
    assert tokens.detokenize(tokens.generate(block, 5)).count(" ") == 4


def test_kv_pool_reuses_freed_runs_and_keeps_data_intact() -> None:
    def blocks(tag: int, n: int) -> list[bytes]:
        return [bytes([tag, i]) * 32 for i in range(n)]

    pool = KVPool(CpuStorage(640), 640, 64)
    pool.put("a", blocks(1, 4))
    pool.put("b", blocks(2, 4))
    pool.free("a")
    # Six blocks: the four freed by "a" plus the last two never used, in two runs.
    digest = pool.put("c", blocks(3, 6))
    assert pool.get("c") == b"".join(blocks(3, 6))
    assert digest == checksum(b"".join(blocks(3, 6)))
    assert pool.get("b") == b"".join(blocks(2, 4))
    assert pool.free_bytes == 0
    with pytest.raises(PoolFullError, match="prompt needs 64 bytes of KV cache, pool has 0 free of 640"):
        pool.put("d", blocks(4, 1))
    assert pool.free("b") and pool.free("c") and not pool.free("c")
    assert pool.free_bytes == 640 and pool.get("b") is None
    pool.close()


def test_kv_pool_of_realistic_size_is_cheap() -> None:
    # The size the upstream vLLM cases use (17 M blocks of 64 bytes); bookkeeping must not be per block.
    pool = KVPool(CpuStorage(1_119_388_000), 1_119_388_000, 64)
    pool.put("x", [b"k" * 64] * 2048)
    assert pool.free_bytes == (1_119_388_000 // 64 - 2048) * 64
    assert len(pool._free_runs) == 1  # the free space is one run, not millions of entries
    pool.close()


# ---------------------------------------------------------------------------------------------------
# Healthy behaviour


def test_healthy_request(launcher: Launcher) -> None:
    pair = launcher.pair()  # healthy within START_TIMEOUT_S, or it raises

    resp = pair.chat(max_tokens=12)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    data = resp.json()
    check_dynamo_shape(data, 12)
    assert data["usage"]["prompt_tokens"] == len(tokens.tokenize(PROMPT))
    assert data["id"].startswith("chatcmpl-")
    # The ids are the workers' own instance ids.
    health = {r: httpx.get(f"{u}/health").json() for r, u in pair.worker_urls.items()}
    assert data["nvext"]["worker_id"]["prefill_worker_id"] == health["prefill"]["instance_id"]
    assert data["nvext"]["worker_id"]["decode_worker_id"] == health["decode"]["instance_id"]
    # temperature 0 behaviour: same prompt, same completion.
    again = pair.chat(max_tokens=12).json()
    assert again["choices"][0]["message"]["content"] == data["choices"][0]["message"]["content"]
    assert again["id"] != data["id"]


def test_streaming_matches_non_streaming(launcher: Launcher) -> None:
    pair = launcher.pair()
    plain = pair.chat(max_tokens=6).json()
    resp = pair.chat(max_tokens=6, stream=True)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream"
    events = [e for e in resp.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"] == plain["usage"]
    assert final["nvext"] == plain["nvext"]
    assert all("usage" not in c for c in chunks[:-1])


def test_models_live_and_health(launcher: Launcher) -> None:
    pair = launcher.pair()
    models = httpx.get(f"{pair.url}/v1/models").json()
    assert models == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "owned_by": "matrix-reference"}],
    }
    assert httpx.get(f"{pair.url}/live").status_code == 200
    health = httpx.get(f"{pair.url}/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "healthy"
    assert [i["role"] for i in body["instances"]] == ["prefill", "decode"]
    for inst in body["instances"]:
        worker = httpx.get(f"{pair.worker_urls[inst['role']]}/health").json()
        assert worker["status"] == "ready" and worker["role"] == inst["role"]
        assert worker["instance_id"] == inst["instance_id"]
    assert body["instances"][0]["instance_id"] != body["instances"][1]["instance_id"]


def test_bad_requests(launcher: Launcher) -> None:
    pair = launcher.pair(frontend_extra=["--max-body-bytes", "4096"])
    url = f"{pair.url}/v1/chat/completions"
    wrong = pair.chat(model="no-such-model")
    assert wrong.status_code == 404
    assert "no-such-model" in wrong.json()["error"]["message"]
    invalid = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert invalid.status_code == 400
    assert "not valid JSON" in invalid.json()["error"]["message"]
    no_user = httpx.post(url, json={"model": MODEL, "messages": [{"role": "system", "content": "x"}]})
    assert no_user.status_code == 400
    assert pair.chat(max_tokens=0).status_code == 400
    assert pair.chat(prompt="x" * 5000).status_code == 413
    assert httpx.get(f"{pair.url}/nowhere").status_code == 404


def test_pool_overflow_is_400_with_message(launcher: Launcher) -> None:
    # 10 blocks of 64 bytes; the prompt needs 16.
    pair = launcher.pair(kv_cache_bytes=640)
    resp = pair.chat()
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "prompt needs 1024 bytes of KV cache, pool has 640 free of 640" in message
    assert "prefill worker" in message
    # A prompt that fits still works on the same pair.
    assert pair.chat(prompt="short prompt").status_code == 200


def test_blocks_are_freed_after_the_pull(launcher: Launcher) -> None:
    # Exactly room for one prompt: a second request only fits if the first one's blocks were freed.
    pair = launcher.pair(kv_cache_bytes=16 * 64)
    for _ in range(3):
        assert pair.chat().status_code == 200
    for url in pair.worker_urls.values():
        health = httpx.get(f"{url}/health").json()
        assert health["kv_free_bytes"] == health["kv_capacity_bytes"] == 1024


def test_unpulled_blocks_expire_after_ttl(launcher: Launcher) -> None:
    proc, port, _side = launcher.worker("prefill", kv_cache_bytes=16 * 64, extra=["--kv-ttl-s", "0.2"])
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: get_status(f"{url}/health") == 200, "prefill health")
    first = httpx.post(f"{url}/prefill", json={"request_id": "a", "prompt": PROMPT})
    assert first.status_code == 200
    assert first.json()["kv"]["num_blocks"] == 16
    assert httpx.get(f"{url}/health").json()["kv_free_bytes"] == 0

    def second_fits() -> bool:
        return httpx.post(f"{url}/prefill", json={"request_id": "b", "prompt": PROMPT}).status_code == 200

    wait_for(second_fits, "the first request's blocks to expire", timeout_s=5)
    assert "kv handle=a expired" in proc.log()


def test_decode_rejects_unknown_handle_and_bad_checksum(launcher: Launcher) -> None:
    pair = launcher.pair()
    pre = httpx.post(f"{pair.worker_urls['prefill']}/prefill", json={"request_id": "r1", "prompt": PROMPT}).json()
    assert pre["prompt_tokens"] == 16 and len(pre["kv"]["checksum"]) == 64
    decode_url = f"{pair.worker_urls['decode']}/decode"

    bad = dict(pre["kv"], checksum="0" * 64)
    resp = httpx.post(decode_url, json={"kv": bad, "max_tokens": 4})
    assert resp.status_code == 502
    assert resp.json()["error"]["message"].startswith("KV transfer failed: checksum mismatch")

    # The verified-bad transfer still consumed the handle, so a retry finds nothing.
    resp = httpx.post(decode_url, json={"kv": pre["kv"], "max_tokens": 4})
    assert resp.status_code == 502
    assert "KV transfer failed: unknown KV handle 'r1'" in resp.json()["error"]["message"]

    pre2 = httpx.post(f"{pair.worker_urls['prefill']}/prefill", json={"request_id": "r2", "prompt": PROMPT}).json()
    ok = httpx.post(decode_url, json={"kv": pre2["kv"], "max_tokens": 4})
    assert ok.status_code == 200
    assert ok.json()["completion_tokens"] == 4 and ok.json()["finish_reason"] == "length"


def test_sigterm_stops_every_process_with_exit_0(launcher: Launcher) -> None:
    pair = launcher.pair()
    assert pair.chat().status_code == 200
    for proc in pair.procs:
        proc.popen.send_signal(signal.SIGTERM)
    for proc in pair.procs:
        assert proc.popen.wait(timeout=5) == 0, proc.log()
        assert "received SIGTERM" in proc.log()
    assert "KV pool freed" in pair.prefill.log()


def test_frontend_is_unhealthy_without_its_decode_worker(launcher: Launcher) -> None:
    pair = launcher.pair()
    os.killpg(pair.decode.popen.pid, signal.SIGKILL)
    pair.decode.popen.wait(timeout=5)
    health = httpx.get(f"{pair.url}/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unhealthy"
    assert [i["role"] for i in health.json()["instances"]] == ["prefill"]
    resp = pair.chat()
    assert resp.status_code == 503
    assert "decode worker" in resp.json()["error"]["message"]


def test_port_in_use_exits_1(launcher: Launcher) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc, _port, _side = launcher.worker("decode", port=busy.getsockname()[1])
        assert proc.popen.wait(timeout=10) == 1
    assert "cannot listen on 127.0.0.1" in proc.log()


def test_unknown_fault_exits_2_listing_known_faults(launcher: Launcher) -> None:
    cli = launcher.worker("prefill", extra=["--fault", "no-such-fault"])[0]
    env = launcher.worker("decode", env={FAULTS_ENV: "slow-start,bogus"})[0]
    for proc, name in ((cli, "no-such-fault"), (env, "bogus")):
        assert proc.popen.wait(timeout=10) == 2
        log = proc.log()
        assert f"unknown fault(s): {name}" in log
        assert all(f in log for f in FAULTS)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_cuda_device_without_torch_exits_2(launcher: Launcher) -> None:
    proc = launcher.worker("prefill", extra=["--device", "cuda"])[0]
    assert proc.popen.wait(timeout=10) == 2
    assert "--device cuda needs torch" in proc.log()


# ---------------------------------------------------------------------------------------------------
# Faults: each must produce the raw behaviour a real engine shows


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_fault_crash_at_start(launcher: Launcher, role: str) -> None:
    proc = launcher.worker(role, extra=["--fault", "crash-at-start"])[0]
    assert proc.popen.wait(timeout=10) == 1
    assert "error:" in proc.log() and "crash-at-start" in proc.log()
    assert "ready" not in proc.log()


def test_fault_hang_at_start(launcher: Launcher) -> None:
    proc, port, _side = launcher.worker("decode", extra=["--fault", "hang-at-start"])
    wait_log(proc, "hanging before listening")
    assert proc.popen.poll() is None
    assert get_status(f"http://127.0.0.1:{port}/health") is None
    # Hung, but still stoppable by SIGTERM like a Python engine stuck in start-up.
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=5) == 0


def test_fault_slow_start(launcher: Launcher) -> None:
    pair = launcher.pair(faults=["slow-start"], worker_extra=["--slow-start-s", "0.4"])
    for worker in (pair.prefill, pair.decode):
        lines = worker.log().splitlines()
        waited = next(i for i, line in enumerate(lines) if "waiting 0.4s before listening (fault slow-start)" in line)
        served = next(i for i, line in enumerate(lines) if " http " in line)  # its first request (a health probe)
        assert waited < served  # nothing was served before the slow start ended
    assert pair.chat().status_code == 200


def test_fault_one_token_completion(launcher: Launcher) -> None:
    pair = launcher.pair(faults=["one-token-completion"])
    data = pair.chat(max_tokens=16).json()
    assert data["usage"]["completion_tokens"] == 1
    assert len(data["choices"][0]["message"]["content"].split()) == 1


def _content(d: dict[str, Any]) -> Any:
    return d["choices"][0]["message"]["content"]


def _ids(d: dict[str, Any]) -> tuple[Any, Any]:
    w = d["nvext"]["worker_id"]
    return w["prefill_worker_id"], w["decode_worker_id"]


@pytest.mark.parametrize(
    ("fault", "check"),
    [
        ("same-worker-id", lambda d: _ids(d)[0] == _ids(d)[1] and isinstance(_ids(d)[0], int)),
        ("empty-completion", lambda d: _content(d) == "" and d["usage"]["completion_tokens"] == 16),
        ("missing-usage", lambda d: "usage" not in d and _content(d).strip() != ""),
        ("bad-finish-reason", lambda d: d["choices"][0]["finish_reason"] == "abort"),
    ],
)
def test_response_faults(launcher: Launcher, fault: str, check: Callable[[dict[str, Any]], bool]) -> None:
    # Through the environment, as a runner would hand one fault set to the whole pair.
    pair = launcher.pair(env_faults=fault)
    resp = pair.chat(max_tokens=16)
    assert resp.status_code == 200
    assert check(resp.json()), resp.text


def test_env_and_cli_faults_are_merged(launcher: Launcher) -> None:
    pair = launcher.pair(faults=["bad-finish-reason"], env_faults="missing-usage")
    data = pair.chat().json()
    assert data["choices"][0]["finish_reason"] == "abort" and "usage" not in data


def test_fault_non_json_body(launcher: Launcher) -> None:
    pair = launcher.pair(faults=["non-json-body"])
    resp = pair.chat()
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    with pytest.raises(json.JSONDecodeError):
        json.loads(resp.content)


def test_fault_oversized_body(launcher: Launcher) -> None:
    pair = launcher.pair(faults=["oversized-body"])
    resp = pair.chat()
    assert resp.status_code == 200
    assert "content-length" not in resp.headers
    assert len(resp.content) > 8 * 1024 * 1024
    data = resp.json()
    check_dynamo_shape(data, 16)


def test_fault_kv_transfer_dropped(launcher: Launcher) -> None:
    pair = launcher.pair(env_faults="kv-transfer-dropped")
    resp = pair.chat()
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert "KV transfer failed: connection closed after" in message
    assert "decode worker" in message
    assert "dropped mid-transfer" in pair.prefill.log()


def test_fault_ignore_sigterm(launcher: Launcher) -> None:
    pair = launcher.pair(env_faults="ignore-sigterm")
    for proc in pair.procs:
        proc.popen.send_signal(signal.SIGTERM)
    # Every process ran again (and so met the pending SIGTERM) to answer this request.
    assert pair.chat().status_code == 200
    for proc in pair.procs:
        assert proc.popen.poll() is None
        assert "ignoring SIGTERM" in proc.log()
        proc.popen.kill()
        assert proc.popen.wait(timeout=5) == -signal.SIGKILL


def test_fault_escaped_child(launcher: Launcher) -> None:
    pair = launcher.pair(env_faults="escaped-child", env={"MATRIX_CELL_ID": "cell-escape-42"})
    match = re.search(r"spawned escaped child pid=(\d+)", pair.prefill.log())
    assert match, pair.prefill.log()
    child_pid = int(match.group(1))
    launcher.stray_pids.append(child_pid)
    child = psutil.Process(child_pid)
    assert child.environ()["MATRIX_CELL_ID"] == "cell-escape-42"
    assert os.getsid(child_pid) == child_pid != os.getsid(pair.prefill.popen.pid)
    assert "escaped child" not in pair.decode.log()
    # Killing the prefill worker's whole process group leaves the child running.
    os.killpg(pair.prefill.popen.pid, signal.SIGKILL)
    pair.prefill.popen.wait(timeout=5)
    assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE


# ---------------------------------------------------------------------------------------------------
# The equivalence oracle's API: completions with token ids and logprobs, an aggregated worker, KV corrupted
# after its checksum


def _aggregated(launcher: Launcher, faults: Sequence[str] = ()) -> str:
    fault_args = [a for f in faults for a in ("--fault", f)]
    worker, port, _side = launcher.worker("aggregated", extra=fault_args)
    fport = free_port()
    args = ["frontend", "--port", str(fport), "--aggregated-url", f"http://127.0.0.1:{port}", "--model", MODEL]
    frontend = launcher.spawn("frontend", args)
    url = f"http://127.0.0.1:{fport}"
    wait_healthy(url, [worker, frontend])
    return url


def _complete(url: str, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_completions_answer_token_ids_and_top_logprobs_in_vllms_shape(launcher: Launcher) -> None:
    pair = launcher.pair()
    data = _complete(pair.url, logprobs=2, return_tokens_as_token_ids=True)
    assert data["object"] == "text_completion" and data["usage"]["completion_tokens"] == 8
    (choice,) = data["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["top_logprobs"]) == len(logprobs["token_logprobs"]) == 8
    for token, top, lp in zip(logprobs["tokens"], logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True):
        assert token.startswith("token_id:") and len(top) == 2
        best, runner_up = sorted(top.items(), key=lambda kv: -kv[1])
        assert best == (token, lp) and best[1] - runner_up[1] >= 2.0  # decisive by construction
    assert len(choice["text"].split()) == 8
    words = _complete(pair.url, logprobs=1)["choices"][0]["logprobs"]["tokens"]
    assert words == choice["text"].split()  # without the flag: the tokens' text


def test_an_aggregated_worker_answers_what_a_healthy_pair_answers(launcher: Launcher) -> None:
    pair, aggregated = launcher.pair(), _aggregated(launcher)
    for prompt in ("kalo mine", PROMPT):
        request = {"prompt": prompt, "logprobs": 2, "return_tokens_as_token_ids": True}
        assert _complete(pair.url, **request)["choices"] == _complete(aggregated, **request)["choices"]
    health = httpx.get(f"{aggregated}/health", timeout=5).json()
    assert {i["role"] for i in health["instances"]} == {"aggregated"}


def test_fault_kv_corrupt_after_checksum_passes_the_transfer_and_changes_the_tokens(launcher: Launcher) -> None:
    pair = launcher.pair(faults=["kv-corrupt-after-checksum"])
    aggregated = _aggregated(launcher, faults=["kv-corrupt-after-checksum"])  # no transfer: nothing to corrupt
    chat = pair.chat(max_tokens=16)
    assert chat.status_code == 200  # the checksum passed: the chat is as healthy as ever
    check_dynamo_shape(chat.json(), 16)
    request = {"logprobs": 2, "return_tokens_as_token_ids": True}
    assert _complete(pair.url, **request)["choices"] != _complete(aggregated, **request)["choices"]
    assert "corrupted the last KV block after its checksum passed" in pair.decode.log()


def test_frontend_needs_a_pair_or_one_aggregated_url(launcher: Launcher) -> None:
    both = ["--prefill-url", "http://127.0.0.1:1", "--aggregated-url", "http://127.0.0.1:2"]
    proc = launcher.spawn("frontend", ["frontend", "--port", str(free_port()), "--model", MODEL, *both])
    assert proc.popen.wait(timeout=10) == 2
    assert "give --prefill-url and --decode-url, or --aggregated-url alone" in proc.log()
