"""The evidence of a hang (`matrix.launch.hang`) read from real processes, and the skew bound on a plan."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from matrix.check.specs import OracleSpec, RequestSpec
from matrix.launch.hang import waiting_on
from matrix.launch.launch_plan import LaunchPlan
from matrix.runner import SKEW_BOUND_S, _bounded
from matrix.skew_outcome import classify

REQUEST = RequestSpec(url="http://127.0.0.1:1/v1/chat/completions", model="m", prompt="p", max_tokens=8)


def test_each_roles_process_tree_state_wchan_and_log_tail_are_read(tmp_path: Path) -> None:
    # A parent that waits on a sleeping child: the shape of an engine and its engine-core process.
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(1.0)
        log = tmp_path / "decode.log"
        log.write_text("starting\nwaiting for remote KV of request 7\n")
        text = waiting_on({"decode": proc.pid, "prefill": 2**22 + 7}, {"decode": log}, REQUEST, 12.3)
    finally:
        proc.kill()
        proc.wait()
    lines = text.splitlines()
    assert lines[0] == f"request in flight: POST {REQUEST.url} (max_tokens 8), no answer after 12.3 s"
    decode = text.split("decode:\n", 1)[1].split("prefill:\n", 1)[0]
    # The parent and its child, each sleeping in the kernel (wait4 / a timed sleep), with their threads.
    assert decode.count("state S (sleeping), wchan ") == 2, decode
    assert f"pid {proc.pid} " in decode and "1 threads: 1 in " in decode, decode
    assert decode.rstrip().endswith("log| waiting for remote KV of request 7"), decode
    assert text.rstrip().endswith(f"pid {2**22 + 7}: exited"), text


def test_a_skew_plan_gives_up_at_the_bound_and_a_shorter_timeout_stays() -> None:
    plan = LaunchPlan(cell_id="c", processes=(), ready_probes=(), request=replace(REQUEST, timeout_s=240.0), ports={},
                      oracle=OracleSpec(url="u", model="m", timeout_s=300.0))  # fmt: skip
    bounded = _bounded(plan, SKEW_BOUND_S)
    assert bounded.request.timeout_s == SKEW_BOUND_S == 120.0
    assert bounded.oracle is not None and bounded.oracle.timeout_s == 120.0
    assert _bounded(replace(plan, request=REQUEST), SKEW_BOUND_S).request.timeout_s == REQUEST.timeout_s


def test_a_hangs_reason_is_its_evidence_not_only_its_first_line() -> None:
    message = "no answer within 120 s after ready; matrix cut the pair\n--- who waited on what ---\ndecode:\n  pid 1"
    verdict = classify("timeout", "request", message, [], {})
    assert verdict.cls == "hang" and verdict.reason == message
