"""The vllm_native arm's plan, the P/D proxy's request shaping, and the kv_transfer check (pure parts)."""

from __future__ import annotations

import json
from pathlib import Path

from matrix.check.metrics import judge, parse_counters
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.plan import MetricsCheck
from matrix.markers import parse_marker_use
from matrix.pdproxy import decode_request, instance_id, prefill_request
from matrix.plan import CaseInfo, RuntimeInfo


def _plan(tmp_path: Path, launch: dict[str, object], gpu_ids: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    case = CaseInfo(
        name="v", backend="vllm", arm="vllm_native", model="tiny", markers=(parse_marker_use("gpu_1"),),
        launch=launch, kv_bound={"bytes": 1073741824},
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
