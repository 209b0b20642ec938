"""The skew bound on a plan, and a hang's evidence as its class's reason (the evidence read from real processes:
tests/e2e/test_hang_evidence_processes.py)."""

from __future__ import annotations

from dataclasses import replace

from matrix.check.specs import OracleSpec, RequestSpec
from matrix.launch.launch_plan import LaunchPlan
from matrix.runner import SKEW_BOUND_S, bounded
from matrix.skew_outcome import classify

REQUEST = RequestSpec(url="http://127.0.0.1:1/v1/chat/completions", model="m", prompt="p", max_tokens=8)


def test_a_skew_plan_gives_up_at_the_bound_and_a_shorter_timeout_stays() -> None:
    plan = LaunchPlan(cell_id="c", processes=(), ready_probes=(), request=replace(REQUEST, timeout_s=240.0), ports={},
                      oracle=OracleSpec(url="u", model="m", timeout_s=300.0))  # fmt: skip
    cut = bounded(plan, SKEW_BOUND_S)
    assert cut.request.timeout_s == SKEW_BOUND_S == 120.0
    assert cut.oracle is not None and cut.oracle.timeout_s == 120.0
    assert bounded(replace(plan, request=REQUEST), SKEW_BOUND_S).request.timeout_s == REQUEST.timeout_s


def test_a_hangs_reason_is_its_evidence_not_only_its_first_line() -> None:
    message = "no answer within 120 s after ready; matrix cut the pair\n--- who waited on what ---\ndecode:\n  pid 1"
    verdict = classify("timeout", "request", message, [], {})
    assert verdict.cls == "hang" and verdict.reason == message
