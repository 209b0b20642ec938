"""The vllm_native arm's plan, the P/D proxy's request shaping, and the kv_transfer check (pure parts)."""

from __future__ import annotations

import json
from pathlib import Path

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.check.metrics import judge, parse_counters
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.launch_plan import MetricsCheck
from matrix.markers import parse_marker_use
from matrix.pdproxy import decode_request, instance_id, prefill_request


def _plan(tmp_path: Path, launch: dict[str, object], gpu_ids: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    case = CaseInfo(
        name="v", backend="vllm", arm="vllm_native", model="tiny", markers=(parse_marker_use("gpu_1"),),
        launch=launch, kv_bound=KvBound(bytes=1073741824),
    )  # fmt: skip
    arm = get_arm("vllm_native")
    ports = {r.name: 30000 + i for i, r in enumerate(arm.port_requests(case))}
    ctx = LaunchContext("cell9", case, RuntimeInfo("vllm", "0.26.0", "v0.26.0"), ports, tmp_path, python="/rt/python",
                        gpu_ids=gpu_ids, model_dir=tmp_path / "model", matrix_python="/matrix/python")  # fmt: skip
    return arm.plan(ctx)


def test_gpu_plan_pins_both_instances_with_absolute_caps(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"gpu_memory_utilization": 0.01}, gpu_ids=("0",))
    prefill, decode, proxy = plan.processes
    for proc, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        argv = proc.argv
        assert argv[:3] == ("/rt/python", "-m", "vllm.entrypoints.openai.api_server")  # not the `vllm` script
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "1073741824"
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.01"
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert config == {"kv_connector": "NixlConnector", "kv_role": role}
        assert proc.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert proxy.argv[:3] == ("/matrix/python", "-m", "matrix.pdproxy")
    (check,) = plan.metrics_checks
    assert check.url == f"http://127.0.0.1:{plan.ports['decode_http']}/metrics"
    assert check.counters == ("vllm:nixl_xfer_time_seconds_count",)


def test_cpu_plan_keeps_the_kv_buffer_in_host_memory(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"cpu": True})
    prefill = plan.processes[0]
    config = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert config["kv_buffer_device"] == "cpu"
    assert "--gpu-memory-utilization" not in prefill.argv
    assert prefill.env["CUDA_VISIBLE_DEVICES"] == ""


def test_proxy_request_shaping() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": False,
            "nvext": {"extra_fields": ["worker_id"]}, "max_completion_tokens": 64}  # fmt: skip
    first = prefill_request(body)
    assert first["max_tokens"] == 1 and first["max_completion_tokens"] == 1
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    assert "nvext" not in first and body["max_tokens"] == 64  # the original is untouched
    kv = {"remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 5600}
    second = decode_request(body, kv)
    assert second["kv_transfer_params"] == kv and second["max_tokens"] == 64 and "nvext" not in second


def test_instance_ids_are_stable_distinct_u64() -> None:
    a = instance_id("prefill", "http://127.0.0.1:1", "engine-a")
    assert a == instance_id("prefill", "http://127.0.0.1:1", "engine-a")
    assert a != instance_id("decode", "http://127.0.0.1:2")
    assert 0 <= a < 2**64


METRICS = """# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:nixl_xfer_time_seconds_count{engine="1",model_name="tiny"} 1.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.5
"""


def test_counters_sum_over_label_sets() -> None:
    assert parse_counters(METRICS, ("vllm:nixl_xfer_time_seconds_count", "absent")) == {
        "vllm:nixl_xfer_time_seconds_count": 3.0,
        "absent": 0.0,
    }


def test_kv_transfer_check_fails_when_the_counter_does_not_grow() -> None:
    check = (MetricsCheck("http://127.0.0.1:1/metrics", ("c",)),)
    assert judge(check, [{"c": 1.0}], [{"c": 2.0}]) == []
    (failure,) = judge(check, [{"c": 2.0}], [{"c": 2.0}])
    assert failure.name == "kv_transfer" and "did not grow" in failure.message
    (failure,) = judge(check, ["cannot read http://127.0.0.1:1/metrics: refused"], [{"c": 2.0}])
    assert "cannot read" in failure.message


def test_cpu_instances_get_their_own_cores() -> None:
    from matrix.launch.arms.vllm_native import omp_binding

    assert omp_binding((0, 1)) == {"prefill": "0", "decode": "1"}
    assert omp_binding((0, 1, 2, 3, 4)) == {"prefill": "0,1", "decode": "2,3,4"}
    assert omp_binding((3,)) == {"prefill": "nobind", "decode": "nobind"}


def test_cpu_plan_binds_each_instance(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"cpu": True, "role_env": {"decode": {"EXTRA": "1"}}})
    prefill, decode = plan.processes[0], plan.processes[1]
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] != decode.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert decode.env["EXTRA"] == "1" and "EXTRA" not in prefill.env


# Decode's /metrics as recorded from real runs (tests/data/metrics): a transfer vllm-rs 0.31.0 made on an
# H200 without filling NIXL's histograms, and a load that vllm-rs 0.29.0 (lacking vllm#54814) let fail.
METRICS_DIR = Path(__file__).resolve().parents[1] / "data" / "metrics"


def test_label_selectors_pick_the_matching_series_only() -> None:
    text = (METRICS_DIR / "vllm-rs-0.31.0-gpu-decode.txt").read_text()
    external = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
    local = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'
    counters = parse_counters(text, (external, local, "vllm:prompt_tokens_by_source_total"))
    assert counters == {external: 96.0, local: 0.0, "vllm:prompt_tokens_by_source_total": 96.0}


def test_sidecar_kv_proof_on_recorded_real_metrics() -> None:
    from matrix.launch.arms.vllm_sidecar import SIDECAR_KV_COUNTERS

    check = (MetricsCheck("http://127.0.0.1:1/metrics", SIDECAR_KV_COUNTERS, "any"),)
    before = [dict.fromkeys(SIDECAR_KV_COUNTERS, 0.0)]
    transferred = parse_counters((METRICS_DIR / "vllm-rs-0.31.0-gpu-decode.txt").read_text(), SIDECAR_KV_COUNTERS)
    assert transferred["vllm:nixl_xfer_time_seconds_count"] == 0.0  # the histogram this server leaves empty
    assert judge(check, before, [transferred]) == []
    failed = parse_counters(
        (METRICS_DIR / "vllm-rs-0.29.0-cpu-decode-failed-load.txt").read_text(), SIDECAR_KV_COUNTERS
    )
    # Decode planned to load 96 prompt tokens from prefill (a prefix-cache "hit"), but the load failed.
    hits = parse_counters((METRICS_DIR / "vllm-rs-0.29.0-cpu-decode-failed-load.txt").read_text(),
                          ("vllm:external_prefix_cache_hits_total",))  # fmt: skip
    assert hits == {"vllm:external_prefix_cache_hits_total": 96.0}
    (failure,) = judge(check, before, [failed])
    assert failure.name == "kv_transfer" and failure.message.startswith("none of ")


def test_any_of_needs_one_counter_to_grow_and_all_of_needs_every_one() -> None:
    any_check = (MetricsCheck("http://127.0.0.1:1/metrics", ("a", "b"), "any"),)
    all_check = (MetricsCheck("http://127.0.0.1:1/metrics", ("a", "b")),)
    assert judge(any_check, [{"a": 0.0, "b": 0.0}], [{"a": 0.0, "b": 1.0}]) == []
    assert [f.message for f in judge(all_check, [{"a": 0.0, "b": 0.0}], [{"a": 0.0, "b": 1.0}])] == [
        "a on http://127.0.0.1:1/metrics did not grow during the request (0 -> 0): decode did not use "
        "transferred KV (recomputed the prompt?)"
    ]


def test_counters_published_late_are_read_again_until_they_grow() -> None:
    import http.server
    import math
    import threading
    import time

    from matrix.check.metrics import settle, snapshot

    # The server publishes the transfer half a second after the test's second read (the clock starts there,
    # not at the top: on a loaded host two reads alone can take that long, and the first reads must miss it).
    published_at = math.inf
    reads: list[str] = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            reads.append(self.path)
            value = 1 if time.monotonic() >= published_at else 0
            body = f"vllm:nixl_xfer_time_seconds_count {value}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        check = (MetricsCheck(f"http://127.0.0.1:{server.server_port}/metrics",
                              ("vllm:nixl_xfer_time_seconds_count",)),)  # fmt: skip
        before = snapshot(check)
        assert judge(check, before, snapshot(check))  # read once at once: missed
        published_at = time.monotonic() + 0.5
        assert judge(check, before, settle(check, before, window_s=5.0)) == []
        # A counter that does not grow any more is read again (not given up on at the first read) until the
        # window closes, then judged.
        now = snapshot(check)
        del reads[:]
        assert judge(check, now, settle(check, now, window_s=0.6))
        assert len(reads) >= 2  # a read every SETTLE_POLL_S (0.25 s) within the window
    finally:
        server.shutdown()


def test_on_two_gpus_prefill_and_decode_run_on_upstreams_devices(tmp_path: Path) -> None:
    """[M32] A `gpu_2` cell gets two GPUs: prefill's engines on the second, decode's and the oracle's aggregated
    instance on the first (Dynamo's disagg.sh layout), each seeing its device only, so NIXL moves the KV
    between devices; with both visible every engine would take the first. A topology's later workers follow
    their role."""
    plan = _plan(tmp_path, {"gpu_memory_utilization": 0.01, "topology": "2p2d"}, gpu_ids=("4", "6"))
    devices = {p.role: p.env.get("CUDA_VISIBLE_DEVICES") for p in plan.processes}
    assert devices["prefill"] == devices["prefill_2"] == "6"
    assert devices["decode"] == devices["decode_2"] == "4"
    one = _plan(tmp_path, {"gpu_memory_utilization": 0.01}, gpu_ids=("4",))
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in one.processes if p.role != "proxy"} == {"4"}
    case = _two_gpu_case()
    arm = get_arm("vllm_native")
    ports = {r.name: 31000 + i for i, r in enumerate((*arm.port_requests(case), *arm.aggregated_port_requests(case)))}
    ctx = LaunchContext("cell9", case, RuntimeInfo("vllm", "0.26.0", "v0.26.0"), ports, tmp_path, python="/rt/python",
                        gpu_ids=("4", "6"), model_dir=tmp_path / "model", matrix_python="/matrix/python")  # fmt: skip
    (aggregated,) = arm.aggregated_plan(ctx).processes
    assert aggregated.env["CUDA_VISIBLE_DEVICES"] == "4"
    # An engine spread over both (tensor parallel) needs both: no split.
    sharded = _plan(tmp_path, {"gpu_memory_utilization": 0.01, "extra_args": ["--tensor-parallel-size=2"]},
                    gpu_ids=("4", "6"))  # fmt: skip
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in sharded.processes if p.role != "proxy"} == {"4,6"}


def _two_gpu_case() -> CaseInfo:
    return CaseInfo(name="v", backend="vllm", arm="vllm_native", model="tiny", markers=(parse_marker_use("gpu_2"),),
                    launch={"gpu_memory_utilization": 0.01}, kv_bound=KvBound(bytes=1073741824))  # fmt: skip
