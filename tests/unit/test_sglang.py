"""SGLang's plans (Dynamo's sidecar and SGLang's own P/D), the proxy's SGLang protocol over real loopback
HTTP, and the KV-transfer proof on SGLang's metrics."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.check.metrics import SETTLE_S, baseline, judge, parse_counters, settle, settle_window, snapshot
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.arms.dynamo import ENGINE_PORTS
from matrix.launch.arms.sglang_server import KV_COUNTERS
from matrix.launch.launch_plan import MetricsCheck
from matrix.markers import parse_marker_use
from matrix.pdproxy import sglang_request

DATA = Path(__file__).parent.parent / "data" / "metrics"


def _case(arm: str, launch: dict[str, object]) -> CaseInfo:
    return CaseInfo(
        name="c", backend="sglang", arm=arm, model="matrix-tiny-random", markers=(parse_marker_use("gpu_1"),),
        launch=launch, kv_bound=KvBound(tokens=2048),
    )  # fmt: skip


def _ctx(case: CaseInfo, tmp_path: Path) -> LaunchContext:
    ports = {req.name: 21000 + i for i, req in enumerate(get_arm(case.arm).port_requests(case))}
    runtime = RuntimeInfo(backend="sglang", version="0.5.21", tag="v0.5.21")
    return LaunchContext("cell1", case, runtime, ports, tmp_path, python="/py", gpu_ids=("2",), model_dir=tmp_path)


def _flag(argv: tuple[str, ...], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def _assert_bounded_server(argv: tuple[str, ...], model_dir: Path) -> None:
    assert argv[:3] == ("/py", "-m", "sglang.launch_server")
    assert _flag(argv, "--model-path") == str(model_dir) and _flag(argv, "--host") == "127.0.0.1"
    # Absolute memory bounds: an exact KV pool, a small static fraction, no CUDA graphs.
    assert _flag(argv, "--max-total-tokens") == "2048" and float(_flag(argv, "--mem-fraction-static")) <= 0.1
    assert "--disable-cuda-graph" in argv and "--enable-metrics" in argv
    # Nothing that JIT-compiles with nvcc (FlashInfer's kernels are not in the GPU wheelhouse).
    assert _flag(argv, "--attention-backend") == "triton" and _flag(argv, "--sampling-backend") == "pytorch"


def test_sidecar_plan_runs_two_servers_two_sidecars_and_the_frontend_on_one_gpu(tmp_path: Path) -> None:
    case = _case("dynamo", {"engine": "sglang", "max_model_len": 1024})
    plan = get_arm("dynamo").plan(_ctx(case, tmp_path))
    by_role = {p.role: p for p in plan.processes}
    assert list(by_role) == ["prefill", "decode", "prefill_sidecar", "decode_sidecar", "frontend"]
    assert len(set(plan.ports.values())) == len(plan.ports)  # every port the allocator's, none shared
    assert set(ENGINE_PORTS["sglang"]) <= set(plan.ports)
    bootstrap = str(plan.ports["SGLANG_DISAGGREGATION_BOOTSTRAP_PORT"])
    for role in ("prefill", "decode"):
        server, sidecar = by_role[role], by_role[f"{role}_sidecar"]
        _assert_bounded_server(server.argv, tmp_path)
        assert _flag(server.argv, "--disaggregation-mode") == role
        assert _flag(server.argv, "--disaggregation-transfer-backend") == "nixl"
        assert _flag(server.argv, "--disaggregation-bootstrap-port") == bootstrap
        assert _flag(server.argv, "--context-length") == "1024"
        grpc = _flag(server.argv, "--grpc-port")
        assert _flag(server.argv, "--nccl-port") == str(plan.ports[f"SGLANG_{role.upper()}_NCCL_PORT"])
        assert server.env["CUDA_VISIBLE_DEVICES"] == "2" and server.env["SGLANG_HOST_IP"] == "127.0.0.1"
        assert server.env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"  # a probe must not generate
        assert "--incremental-streaming-output" in server.argv  # the sidecar refuses a server without it
        assert server.health[0].url.endswith(f":{_flag(server.argv, '--port')}/health")
        # The sidecar is the module (ai-dynamo installs no executable of that name), on the server's gRPC port.
        assert sidecar.argv[:3] == ("/py", "-m", "dynamo.sglang.sidecar")
        assert _flag(sidecar.argv, "--grpc-endpoint") == f"127.0.0.1:{grpc}"
        assert _flag(sidecar.argv, "--disaggregation-mode") == role
        assert _flag(sidecar.argv, "--bootstrap-host") == "127.0.0.1"
        assert sidecar.start_after == (role,)
        assert sidecar.env["DYN_SYSTEM_PORT"] == str(plan.ports[f"{role}_system"])
    assert _flag(by_role["prefill_sidecar"].argv, "--component") == "prefill"
    (check,) = plan.metrics_checks
    assert check.url == f"http://127.0.0.1:{plan.ports['SGLANG_PREFILL_HTTP_PORT']}/metrics"
    assert check.counters == KV_COUNTERS and check.record == str(tmp_path / "metrics-prefill.prom")


def test_native_plan_puts_the_proxy_in_front_with_sglang_protocol(tmp_path: Path) -> None:
    plan = get_arm("sglang_native").plan(_ctx(_case("sglang_native", {}), tmp_path))
    by_role = {p.role: p for p in plan.processes}
    assert list(by_role) == ["prefill", "decode", "proxy"]
    for role in ("prefill", "decode"):
        _assert_bounded_server(by_role[role].argv, tmp_path)
        assert _flag(by_role[role].argv, "--disaggregation-mode") == role
        assert "--grpc-port" not in by_role[role].argv
    proxy = by_role["proxy"].argv
    assert proxy[1:3] == ("-m", "matrix.pdproxy") and _flag(proxy, "--protocol") == "sglang"
    assert _flag(proxy, "--bootstrap-port") == str(plan.ports["SGLANG_DISAGGREGATION_BOOTSTRAP_PORT"])
    assert _flag(proxy, "--prefill-url") == f"http://127.0.0.1:{plan.ports['SGLANG_PREFILL_HTTP_PORT']}"
    assert not get_arm("sglang_native").runs_on_cpu(_case("sglang_native", {}))


def test_control_runs_plain_servers_that_cannot_transfer(tmp_path: Path) -> None:
    plan = get_arm("sglang_native").plan(_ctx(_case("sglang_native", {"aggregated_servers": True}), tmp_path))
    for spec in plan.processes[:2]:
        assert not any(a.startswith("--disaggregation") for a in spec.argv)
    assert plan.metrics_checks[0].counters == KV_COUNTERS


def test_sglang_request_carries_the_pairing_fields() -> None:
    body = {"model": "m", "messages": [], "stream": True, "nvext": {"x": 1}, "stream_options": {}}
    request = sglang_request(body, "127.0.0.1", 4242, 7)
    assert request["stream"] is False and "nvext" not in request and "stream_options" not in request
    assert (request["bootstrap_host"], request["bootstrap_port"], request["bootstrap_room"]) == ("127.0.0.1", 4242, 7)
    assert body["stream"] is True  # the client's body is not changed


# --- the proxy's SGLang protocol over real loopback HTTP --------------------------------------------------


# --- the KV-transfer proof on SGLang's own metrics ------------------------------------------------------------


def test_kv_proof_counts_finished_transfers_on_recorded_real_metrics() -> None:
    before = parse_counters((DATA / "sglang-0.5.21-prefill-before.prom").read_text(), KV_COUNTERS)
    after = parse_counters((DATA / "sglang-0.5.21-prefill-after.prom").read_text(), KV_COUNTERS)
    assert before[KV_COUNTERS[0]] == 0 and after[KV_COUNTERS[0]] >= 1  # warm-up is not counted, the request is
    check = MetricsCheck("http://127.0.0.1:1/metrics", KV_COUNTERS)
    assert judge((check,), [before], [after]) == []
    # Recorded on an H200: the control's plain servers (nothing moved) and SGLang 0.5.18's sidecar cell, whose
    # prefill died on the gRPC bridge's missing batch_size before any transfer.
    for name in ("sglang-0.5.21-aggregated.prom", "sglang-0.5.18-sidecar-prefill-failed.prom"):
        counters = parse_counters((DATA / name).read_text(), KV_COUNTERS)
        assert [f.name for f in judge((check,), [before], [counters])] == ["kv_transfer"], name


def test_settle_keeps_the_scrape_it_judged(tmp_path: Path) -> None:
    text = "# TYPE sglang:kv_transfer_latency_ms histogram\nsglang:kv_transfer_latency_ms_count{model_name=\"m\"} 1.0\n"

    class Metrics(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        record = tmp_path / "metrics-prefill.prom"
        check = MetricsCheck(f"http://127.0.0.1:{server.server_address[1]}/metrics", KV_COUNTERS, record=str(record))
        assert baseline((check,)) == [{KV_COUNTERS[0]: 1.0}]
        assert (tmp_path / "before-metrics-prefill.prom").read_text() == text
        before = [{KV_COUNTERS[0]: 0.0}]
        after = settle((check,), before, window_s=0.5)
        assert judge((check,), before, after) == [] and record.read_text() == text
        assert snapshot((check,)) == after
    finally:
        server.shutdown()
        server.server_close()


def test_only_a_served_request_waits_for_its_counters() -> None:
    assert settle_window(200) == SETTLE_S
    assert settle_window(500) == settle_window(502) == settle_window(None) == 0.0
