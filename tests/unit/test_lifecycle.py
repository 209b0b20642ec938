"""[M22] The lifecycle checks' pure parts: reading scheduler gauges, judging a release, the orphaned
decode's request, and the plans that carry them (the aggregated twins included)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from matrix.check.lifecycle import Evidence, held_at_rest, orphan_payload, parse_gauges, released
from matrix.check.specs import EngineGauges, RequestSpec
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm
from tests.helpers.catalogs import arm_case, arm_ctx

VLLM = EngineGauges("decode", "http://127.0.0.1:1/metrics")

# The shape vLLM publishes: HELP/TYPE lines, labels per engine, gauges as floats.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.03125
vllm:num_requests_running_total_something 7
"""


def test_gauges_are_read_by_exact_name_and_summed_over_label_sets() -> None:
    assert parse_gauges(VLLM_TEXT, VLLM) == {"running": 1.0, "waiting": 0.0, "kv_usage": 0.03125}
    two_engines = VLLM_TEXT + 'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
    assert parse_gauges(two_engines, VLLM)["running"] == 3.0  # type: ignore[index]
    assert parse_gauges("vllm:num_requests_running 4 1700000000\n" + VLLM_TEXT, VLLM)["running"] == 5.0  # type: ignore[index]


def test_a_gauge_the_engine_does_not_publish_is_an_error_not_an_idle_engine() -> None:
    renamed = VLLM_TEXT.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_gauges(renamed, VLLM) == "http://127.0.0.1:1/metrics publishes no vllm:kv_cache_usage_perc"


def test_released_names_what_each_engine_still_holds() -> None:
    idle = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    before = {"prefill": idle, "decode": idle}
    assert released(before, {"prefill": idle, "decode": idle}) == []
    busy = {"running": 1.0, "waiting": 2.0, "kv_usage": 0.5}
    assert released(before, {"prefill": idle, "decode": busy}) == ["decode: 1 running, 2 waiting, KV usage 0.5 (was 0)"]
    assert released(before, {"prefill": "cannot read x", "decode": idle}) == ["prefill: cannot read x"]
    # KV usage at or below its earlier level is back (prefix caching may even lower it).
    assert released({"decode": {**idle, "kv_usage": 0.2}}, {"decode": {**idle, "kv_usage": 0.1}}) == []


def test_at_rest_is_nothing_in_flight_and_no_more_kv_than_before_the_cells_first_request() -> None:
    idle = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    kept = {**idle, "kv_usage": 0.00097704}  # four blocks a NIXL prefill keeps for its lease
    assert held_at_rest({"prefill": idle, "decode": idle}) == []
    assert held_at_rest({"prefill": kept, "decode": idle}) == ["prefill: KV usage 0.00097704"]
    # Engines a skew grid shares may start the cell holding an earlier cell's blocks: that level is the floor.
    assert held_at_rest({"prefill": kept}, {"prefill": kept}) == []
    more = {**idle, "kv_usage": 0.00195408}
    assert held_at_rest({"prefill": more}, {"prefill": kept}) == [
        "prefill: KV usage 0.00195408 (was 0.00097704 before the request)"
    ]
    # No readable floor: zero, what an idle engine reads; work in flight is never at rest.
    assert held_at_rest({"prefill": kept}, {"prefill": "cannot read x"}) == ["prefill: KV usage 0.00097704"]
    assert held_at_rest({"decode": {**idle, "waiting": 1.0}}, {"decode": {**idle, "waiting": 1.0}}) == [
        "decode: 1 waiting"
    ]
    assert held_at_rest({"decode": "cannot read x"}) == ["decode: cannot read x"]


def test_the_orphaned_decode_promises_kv_from_a_prefill_that_does_not_exist() -> None:
    request = RequestSpec("http://127.0.0.1:1/v1/chat/completions", "m", "hi", max_tokens=64)
    params = orphan_payload(request, 4242)["kv_transfer_params"]
    assert isinstance(params, dict)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 4242)
    reference = orphan_payload(request, 4242, "reference")
    assert reference["kv"]["port"] == 4242 and reference["stream"] is True  # type: ignore[index]


def test_evidence_of_a_skipped_check_says_why_and_is_neither_pass_nor_fail(tmp_path: Path) -> None:
    Evidence("orphan_decode_released", 30.0, skipped="no public API").write(str(tmp_path))
    document = json.loads((tmp_path / "orphan_decode_released.json").read_text())
    assert document["passed"] is None and document["skipped"] == "no public API"


def test_the_native_pair_watches_both_instances_and_sends_the_orphan_to_decode(tmp_path: Path) -> None:
    case = arm_case("vllm_native", {"cpu": True, "max_model_len": 512}, kv_bound=KvBound(bytes=268435456))
    ctx = arm_ctx(case, tmp_path)
    spec = get_arm("vllm_native").plan(ctx).lifecycle
    assert spec is not None and spec.stream
    assert [(e.role, e.url) for e in spec.engines] == [
        (role, f"http://127.0.0.1:{ctx.ports[f'{role}_http']}/metrics") for role in ("prefill", "decode")
    ]
    assert spec.orphan_url == f"http://127.0.0.1:{ctx.ports['decode_http']}/v1/chat/completions"
    assert spec.cancel_max_tokens == 384  # max_model_len 512 less room for the prompt


def test_the_sidecar_system_skips_the_orphan_check_saying_why(tmp_path: Path) -> None:
    case = arm_case("dynamo", {"engine": "vllm", "cpu": True, "max_model_len": 512}, kv_bound=KvBound(bytes=268435456))
    spec = get_arm("dynamo").plan(arm_ctx(case, tmp_path)).lifecycle
    assert spec is not None and [e.role for e in spec.engines] == ["prefill", "decode"]
    assert spec.orphan_url is None and "no public API" in str(spec.orphan_skip)


def test_the_aggregated_vllm_twin_is_one_engine_without_a_connector_behind_one_agg_sidecar(tmp_path: Path) -> None:
    launch = {"engine": "vllm", "cpu": True, "max_model_len": 512, "aggregated": True}
    case = arm_case("dynamo", launch, kv_bound=KvBound(bytes=268435456))
    ctx = replace(arm_ctx(case, tmp_path), cpu_ids=(0, 1))
    plan = get_arm("dynamo").plan(ctx)
    by_role = {p.role: p for p in plan.processes}
    assert set(by_role) == {"worker", "worker_sidecar", "frontend"}
    assert "--kv-transfer-config" not in by_role["worker"].argv
    assert by_role["worker"].env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"  # the one engine gets every core
    sidecar = by_role["worker_sidecar"].argv
    assert sidecar[sidecar.index("--disaggregation-mode") + 1] == "agg"
    assert plan.metrics_checks == ()  # nothing moves, so no transfer counter must grow
    assert plan.lifecycle is not None and [e.role for e in plan.lifecycle.engines] == ["worker"]


def test_the_aggregated_sglang_twin_is_one_plain_server_behind_one_agg_sidecar(tmp_path: Path) -> None:
    launch = {"engine": "sglang", "aggregated": True}
    case = replace(arm_case("dynamo", launch, kv_bound=KvBound(tokens=2048)), backend="sglang")
    plan = get_arm("dynamo").plan(arm_ctx(case, tmp_path, gpu_ids=("0",)))
    by_role = {p.role: p for p in plan.processes}
    assert set(by_role) == {"worker", "worker_sidecar", "frontend"}
    assert "--disaggregation-mode" not in by_role["worker"].argv and "--grpc-port" in by_role["worker"].argv
    sidecar = by_role["worker_sidecar"].argv
    assert sidecar[sidecar.index("--disaggregation-mode") + 1] == "agg"
    assert plan.metrics_checks == ()
