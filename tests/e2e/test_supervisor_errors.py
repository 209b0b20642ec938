"""[M11] item 12: failures name their cause even when a process keeps talking after it.

A process that logs its fatal error once and then a line per request (Dynamo 1.1.1-1.3.1's frontend)
pushes the cause out of any log tail: the error lines of the whole log go into the failure message, the
start-up fails once the fatal line has stood for a few seconds without readiness (not after the whole
timeout), and a server that answers is probed ever less often, up to every half second, not every 50 ms.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from matrix.launch.launch_plan import HealthProbe, ProcessSpec
from matrix.launch.supervisor import FATAL_GRACE_S, LOG_TAIL_LINES, Supervisor, _kernel_state
from tests.helpers.supervisor import make_plan, models_probe

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# Logs a fatal model error once, then serves an empty model list forever, logging every request.
CHATTY_SERVER = textwrap.dedent("""
    import http.server, json, sys, time
    print("ERROR dynamo_llm::discovery: Failed to load model 'Qwen/Qwen3-0.6B': config.json not found", flush=True)
    for i in range(%d):
        print(f"INFO dynamo_runtime: heartbeat {i}", flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": []}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            print(f"http response sent status=200 at={time.monotonic():.4f}", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""") % (LOG_TAIL_LINES * 2)


def test_a_fatal_line_fails_the_start_fast_and_is_in_the_message(tmp_path: Path, ports: list[int]) -> None:
    server = ProcessSpec(role="frontend", argv=(sys.executable, "-c", CHATTY_SERVER, str(ports[0])))
    plan = make_plan((server,), ports, ready_probes=(models_probe(ports[0]),), startup_timeout_s=100.0)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        ready = sup.wait_ready()
    assert not ready.ok and ready.kind == "startup", ready  # not a timeout after 100 s
    assert f"frontend logged a fatal error and was still not ready {FATAL_GRACE_S:g} s later" in ready.message
    assert "Failed to load model 'Qwen/Qwen3-0.6B'" in ready.message
    assert "Failed to load model" in ready.error_lines and "heartbeat" not in ready.error_lines
    assert "Failed to load model" not in ready.log_tail  # the tail alone would have lost it
    # Probes of a server that answers start close together (one about to be ready is noticed soon) and
    # spread out to half a second (one log line each): over the 5 s grace about 30, not the 100 of a 50 ms
    # poll, and more of them in the first half of that time than in the second.
    log = (tmp_path / "logs" / "frontend.log").read_text()
    times = [float(m[1]) for m in re.finditer(r"http response sent status=200 at=([0-9.]+)$", log, re.MULTILINE)]
    assert 3 <= len(times) <= 45, times
    middle = (times[0] + times[-1]) / 2
    assert sum(t < middle for t in times) > sum(t > middle for t in times), times


def test_a_crash_message_carries_the_traceback_from_the_whole_log(tmp_path: Path, ports: list[int]) -> None:
    code = (
        "import sys\n"
        "print('Traceback (most recent call last):')\n"
        "print('  File \"engine.py\", line 1, in <module>')\n"
        "print('ValueError: boom: the real cause')\n"
        f"for i in range({LOG_TAIL_LINES * 3}): print(f'shutting down worker {{i}}')\n"
        "sys.exit(1)\n"
    )
    health = (HealthProbe(f"http://127.0.0.1:{ports[0]}/health"),)  # never answers: the exit decides
    plan = make_plan((ProcessSpec(role="decode", argv=(sys.executable, "-c", code), health=health),), ports)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        ready = sup.wait_ready()
    assert ready.kind == "startup"
    assert ready.message == "decode exited with code 1 before it was ready (ValueError: boom: the real cause)"
    assert "Traceback (most recent call last)" in ready.error_lines
    assert "ValueError: boom: the real cause" in ready.error_lines
    assert "ValueError" not in ready.log_tail


def test_an_engine_that_kills_its_own_tree_is_named_by_its_exception(tmp_path: Path, ports: list[int]) -> None:
    # SGLang's launcher SIGKILLs its whole process tree when its scheduler fails ("Loaded weights leave no GPU
    # memory for the KV cache ..."): the signal alone said nothing of why.
    code = (
        "import os, signal\n"
        "print('Scheduler hit an exception: Traceback (most recent call last):')\n"
        "print('ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.05.')\n"
        "print('kill_process_tree called: include_parent=True', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    health = (HealthProbe(f"http://127.0.0.1:{ports[0]}/health"),)
    plan = make_plan((ProcessSpec(role="prefill", argv=(sys.executable, "-c", code), health=health),), ports)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        ready = sup.wait_ready()
    assert ready.message == ("prefill was killed by SIGKILL before it was ready (ValueError: Loaded weights leave "
                             "no GPU memory for the KV cache under --mem-fraction-static=0.05.)")  # fmt: skip


# A frontend that says healthy from the start but discovers its second worker only after 20 answers, as
# Dynamo's does when the decode worker registers before the prefill worker.
DISCOVERING_FRONTEND = textwrap.dedent("""
    import http.server, json, sys
    answers = 0
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            global answers
            answers += 1
            endpoints = ["dyn://ns.backend.generate"] + (["dyn://ns.prefill.generate"] if answers > 20 else [])
            body = json.dumps({"status": "healthy", "endpoints": endpoints}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
            print(f"answer {answers} endpoints={len(endpoints)}", flush=True)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_ready_waits_until_the_frontend_lists_every_worker_endpoint(tmp_path: Path, ports: list[int]) -> None:
    """[M17] a 200 /health alone let a mocker cell send its request before the prefill worker was routable."""
    server = ProcessSpec(role="frontend", argv=(sys.executable, "-c", DISCOVERING_FRONTEND, str(ports[0])))
    wanted = (".generate", ".generate")  # two distinct workers, as the mocker plan asks
    probe = HealthProbe(f"http://127.0.0.1:{ports[0]}/health", require_endpoints=wanted)
    plan = make_plan((server,), ports, ready_probes=(probe,), startup_timeout_s=60.0)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        ready = sup.wait_ready()
    assert ready.ok, ready
    answers = re.findall(r"answer (\d+) endpoints=(\d)", (tmp_path / "logs" / "frontend.log").read_text())
    assert answers[-1] == ("21", "2"), answers  # ready at the first answer listing both, not before


# [M27] Dynamo's /health lists an endpoint once however many workers serve it; its `instances` name each worker.
# This frontend lists both components' endpoints from the start, and its fourth worker's instance after 10 answers.
INSTANCES_FRONTEND = textwrap.dedent("""
    import http.server, json, sys
    answers = 0
    def instance(component, n):
        return {"namespace": "ns", "component": component, "endpoint": "generate", "instance_id": n}
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            global answers
            answers += 1
            instances = [instance("prefill", 1), instance("prefill", 2), instance("backend", 3)]
            instances += [instance("backend", 4)] if answers > 10 else []
            body = json.dumps({"status": "healthy", "endpoints": ["dyn://ns.backend.generate",
                               "dyn://ns.prefill.generate"], "instances": instances}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
            print(f"answer {answers} instances={len(instances)}", flush=True)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_ready_counts_the_frontends_instances_so_a_topology_waits_for_every_worker(
    tmp_path: Path, ports: list[int]
) -> None:
    server = ProcessSpec(role="frontend", argv=(sys.executable, "-c", INSTANCES_FRONTEND, str(ports[0])))
    probe = HealthProbe(f"http://127.0.0.1:{ports[0]}/health", require_endpoints=(".generate",) * 4)  # 2p2d
    plan = make_plan((server,), ports, ready_probes=(probe,), startup_timeout_s=60.0)
    with Supervisor(plan, tmp_path / "logs") as sup:
        sup.start()
        ready = sup.wait_ready()
    assert ready.ok, ready
    answers = re.findall(r"answer (\d+) instances=(\d)", (tmp_path / "logs" / "frontend.log").read_text())
    assert answers[-1] == ("11", "4"), answers  # two endpoints listed from the start were not four workers


def test_a_process_that_outlives_its_reap_wait_is_described_by_its_kernel_state() -> None:
    """When a SIGKILLed worker is not reaped in time, the peer-loss check quotes what the kernel says it is doing
    (state and wait channel), so a stuck exit is explained rather than only reported."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while "state S" not in (state := _kernel_state(sleeper.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert re.fullmatch(r"state S \(sleeping\)(, in \w+)?", state), state
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _kernel_state(sleeper.pid).startswith("unreadable (")
