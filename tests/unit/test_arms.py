"""Launch plans of the arms are pure data: built and checked here without starting anything."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import ConfigError
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm, known_arms
from matrix.launch.arms.base import LaunchContext
from matrix.launch.arms.dynamo import ENGINE_PORTS, SYSTEM_PORT_MAX
from tests.helpers.catalogs import arm_case, arm_ctx


def test_registry_is_explicit_and_unknown_arms_fail_before_anything_starts() -> None:
    assert known_arms() == {"reference", "dynamo", "vllm_native", "sglang_native"}
    known = "dynamo, reference, sglang_native, vllm_native"
    with pytest.raises(ConfigError, match=f"unknown arm 'sidecar'; known arms: {known}"):
        get_arm("sidecar")


def test_unknown_dynamo_engine_fails_loudly() -> None:
    with pytest.raises(ConfigError, match="unknown dynamo engine 'trt'"):
        get_arm("dynamo").port_requests(arm_case("dynamo", {"engine": "trt"}))


def test_mocker_plan(tmp_path: Path) -> None:
    case = arm_case("dynamo", {"engine": "mocker"})
    requests = {r.name: r.max_port for r in get_arm("dynamo").port_requests(case)}
    assert requests["prefill_system"] == requests["decode_system"] == SYSTEM_PORT_MAX  # parsed as i16 upstream
    plan = get_arm("dynamo").plan(arm_ctx(case, tmp_path))
    roles = [p.role for p in plan.processes]
    assert roles == ["prefill", "decode", "frontend"]
    prefill = plan.processes[0]
    assert prefill.argv[:3] == ("/py", "-m", "dynamo.mocker")
    assert (
        "--disaggregation-mode" in prefill.argv
        and prefill.argv[prefill.argv.index("--disaggregation-mode") + 1] == "prefill"
    )
    assert prefill.argv[prefill.argv.index("--model-path") + 1] == str(tmp_path)
    env = prefill.env
    assert env["DYN_SYSTEM_PORT"] == str(plan.ports["prefill_system"])
    assert env["DYN_DISCOVERY_BACKEND"] == "file" and env["DYN_FILE_KV"].startswith(str(tmp_path))
    assert env["DYN_REQUEST_PLANE"] == "tcp" and env["DYN_NAMESPACE"] == "matrix-cell1"
    for host_var in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"):
        assert env[host_var] == "127.0.0.1"
    assert env["DYN_TCP_RESPONSE_STREAM_HOST"] == "lo"  # an interface name: what every release accepts
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # CPU cell: no GPU visible
    # Dynamo leaves a logging configuration in TMPDIR at every start-up: the cell's own, removed with it.
    assert env["TMPDIR"] == str(Path(tempfile.gettempdir()) / "matrix-cell1")
    assert all(p.env["TMPDIR"] == env["TMPDIR"] for p in plan.processes)
    assert plan.scratch_dirs.count(env["TMPDIR"]) == 1
    frontend = plan.processes[2]
    assert "--http-host" in frontend.argv and frontend.argv[frontend.argv.index("--http-host") + 1] == "127.0.0.1"
    assert plan.ready_probes[0].require_models


def test_aggregated_control_has_one_worker(tmp_path: Path) -> None:
    case = arm_case("dynamo", {"engine": "mocker", "aggregated": True})
    plan = get_arm("dynamo").plan(arm_ctx(case, tmp_path))
    assert [p.role for p in plan.processes] == ["worker", "frontend"]
    assert "--disaggregation-mode" not in plan.processes[0].argv


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_gpu_engines_get_their_ports_and_pins_through_the_script_environment(tmp_path: Path, engine: str) -> None:
    script = tmp_path / "lib" / "sidecar" / engine / "launch" / "disagg.sh"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/bash\n")
    case = arm_case(
        "dynamo", {"engine": engine, "script": f"lib/sidecar/{engine}/launch/disagg.sh"}, source_dir=str(tmp_path)
    )
    plan = get_arm("dynamo").plan(arm_ctx(case, tmp_path, gpu_ids=("3",)))
    (workers,) = [p for p in plan.processes if p.role == "workers"]
    assert workers.argv == ("bash", str(script))
    assert workers.cwd == str(script.parent)  # helpers resolve relative to the script (SCRIPT_DIR)
    for name in ENGINE_PORTS[engine]:
        assert workers.env[name] == str(plan.ports[name])
    assert len({plan.ports[n] for n in ENGINE_PORTS[engine]}) == len(ENGINE_PORTS[engine])
    assert workers.env["CUDA_VISIBLE_DEVICES"] == "3"
    if engine == "trtllm":
        assert workers.env["TRTLLM_PREFILL_GPU"] == workers.env["TRTLLM_DECODE_GPU"] == "3"
        assert workers.env["PRTE_ALLOW_RUN_AS_ROOT"] == "1"


@pytest.mark.parametrize(
    ("engine", "bound", "launch", "args", "env"),
    [
        ("vllm", {"bytes": 1119388000}, {"max_model_len": 2048},
         ("--kv-cache-memory-bytes", "1119388000", "--gpu-memory-utilization", "0.01"), {"MAX_MODEL_LEN": "2048"}),
        ("sglang", {"tokens": 2048}, {"disable_cuda_graph": True},
         ("--max-total-tokens", "2048", "--disable-cuda-graph"), {}),
        ("trtllm", {"tokens": 2048}, {}, (), {"TRTLLM_KV_MAX_TOKENS": "2048"}),
    ],
)  # fmt: skip
def test_gpu_engines_get_absolute_kv_bounds(
    tmp_path: Path, engine: str, bound: dict[str, int], launch: dict[str, object], args: tuple[str, ...],
    env: dict[str, str],
) -> None:  # fmt: skip
    script = tmp_path / "disagg.sh"
    script.write_text("#!/bin/bash\n")
    case = arm_case("dynamo", {"engine": engine, "script": "disagg.sh", **launch}, source_dir=str(tmp_path),
                 kv_bound=KvBound.parse(bound))  # fmt: skip
    (workers,) = [
        p for p in get_arm("dynamo").plan(arm_ctx(case, tmp_path, gpu_ids=("0",))).processes if p.role == "workers"
    ]
    assert workers.argv == ("bash", str(script), *args)
    assert env.items() <= dict(workers.env).items()


def test_launch_scripts_resolve_against_the_workspace(tmp_path: Path) -> None:
    checkout = tmp_path / "dynamo"
    (checkout / "lib").mkdir(parents=True)
    (checkout / "lib" / "disagg.sh").write_text("#!/bin/bash\n")
    case = arm_case("dynamo", {"engine": "vllm", "script": "lib/disagg.sh"}, source_dir=str(tmp_path / "catalog"))
    with pytest.raises(ConfigError, match=r"launch script lib/disagg\.sh not found .* --workspace"):
        get_arm("dynamo").plan(arm_ctx(case, tmp_path))
    ctx = arm_ctx(case, tmp_path)
    plan = get_arm("dynamo").plan(replace(ctx, workspace=checkout))
    assert plan.processes[0].argv[1] == str(checkout / "lib" / "disagg.sh")


def test_gpu_engine_without_a_script_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs launch\.script"):
        get_arm("dynamo").plan(arm_ctx(arm_case("dynamo", {"engine": "trtllm"}), tmp_path))


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


SIDECAR_CASE = {"engine": "vllm", "max_model_len": 2048, "gpu_memory_utilization": 0.01,
                "workspace_script": "lib/sidecar/vllm/launch/disagg.sh"}  # fmt: skip


def test_vllm_sidecar_plan_runs_five_processes_on_one_gpu(tmp_path: Path) -> None:
    case = arm_case("dynamo", SIDECAR_CASE, kv_bound=KvBound(bytes=1119388000))
    plan = get_arm("dynamo").plan(arm_ctx(case, tmp_path, gpu_ids=("3",)))
    by_role = {p.role: p for p in plan.processes}
    assert list(by_role) == ["prefill", "decode", "prefill_sidecar", "decode_sidecar", "frontend"]
    assert len(set(plan.ports.values())) == len(plan.ports)  # every port the allocator's, none shared
    for role in ("prefill", "decode"):
        engine, sidecar = by_role[role], by_role[f"{role}_sidecar"]
        head, python_args = engine.argv[: engine.argv.index("--")], engine.argv[engine.argv.index("--") + 1 :]
        assert head[:3] == ("vllm-rs", "serve", str(tmp_path))
        assert _flag(head, "--python") == "/py" and _flag(head, "--host") == "127.0.0.1"
        http, grpc = plan.ports[f"VLLM_{role.upper()}_HTTP_PORT"], plan.ports[f"VLLM_{role.upper()}_GRPC_PORT"]
        assert _flag(head, "--port") == str(http) and _flag(head, "--grpc-port") == str(grpc)
        assert _flag(head, "--max-model-len") == "2048" and _flag(head, "--reasoning-parser") == "none"
        assert "--enforce-eager" in python_args
        assert json.loads(_flag(python_args, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector", "kv_role": "kv_both"}  # fmt: skip
        assert _flag(python_args, "--kv-cache-memory-bytes") == "1119388000"
        assert _flag(python_args, "--gpu-memory-utilization") == "0.01"
        side = plan.ports[f"VLLM_{role.upper()}_NIXL_SIDE_CHANNEL_PORT"]
        assert engine.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(side)
        assert engine.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert engine.health[0].url == f"http://127.0.0.1:{http}/health"
        # The sidecar registers its own engine, and only once that engine answers.
        assert sidecar.argv[:3] == ("/py", "-m", "dynamo.vllm.sidecar")
        assert _flag(sidecar.argv, "--grpc-endpoint") == f"127.0.0.1:{grpc}"
        assert _flag(sidecar.argv, "--disaggregation-mode") == role
        assert sidecar.start_after == (role,)
        system = int(sidecar.env["DYN_SYSTEM_PORT"])
        assert system == plan.ports[f"{role}_system"] <= SYSTEM_PORT_MAX
        assert sidecar.health[0].url == f"http://127.0.0.1:{system}/health"
    assert _flag(by_role["prefill_sidecar"].argv, "--component") == "prefill"
    assert "--component" not in by_role["decode_sidecar"].argv
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in plan.processes} == {"3"}
    assert {p.env["DYN_NAMESPACE"] for p in plan.processes} == {"matrix-cell1"}
    (metrics,) = plan.metrics_checks
    assert metrics.url == f"http://127.0.0.1:{plan.ports['VLLM_DECODE_HTTP_PORT']}/metrics"
    assert metrics.counters == (
        "vllm:nixl_xfer_time_seconds_count", 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}')
    assert metrics.require == "any"  # either proves the transfer
    assert plan.ready_probes[0].url == f"http://127.0.0.1:{plan.ports['frontend']}/v1/models"


def test_vllm_sidecar_plan_on_cpu_keeps_kv_in_host_memory_and_splits_the_cores(tmp_path: Path) -> None:
    case = arm_case("dynamo", {"engine": "vllm", "cpu": True, "max_model_len": 512}, kv_bound=KvBound(bytes=268435456))
    assert get_arm("dynamo").runs_on_cpu(case)
    assert not get_arm("dynamo").runs_on_cpu(arm_case("dynamo", {"engine": "vllm"}))
    ctx = replace(arm_ctx(case, tmp_path), cpu_ids=(0, 1))
    by_role = {p.role: p for p in get_arm("dynamo").plan(ctx).processes}
    prefill, decode = by_role["prefill"], by_role["decode"]
    python_args = prefill.argv[prefill.argv.index("--") + 1 :]
    assert json.loads(_flag(python_args, "--kv-transfer-config"))["kv_buffer_device"] == "cpu"
    assert "--gpu-memory-utilization" not in python_args
    assert prefill.env["VLLM_TARGET_DEVICE"] == "cpu" and prefill.env["CUDA_VISIBLE_DEVICES"] == ""
    assert (prefill.env["VLLM_CPU_OMP_THREADS_BIND"], decode.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert "VLLM_TARGET_DEVICE" not in by_role["decode_sidecar"].env


def test_vllm_sidecar_runs_upstreams_script_only_with_a_workspace(tmp_path: Path) -> None:
    checkout = tmp_path / "dynamo"
    script = checkout / "lib" / "sidecar" / "vllm" / "launch" / "disagg.sh"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/bash\n")
    case = arm_case("dynamo", SIDECAR_CASE, kv_bound=KvBound(bytes=1119388000), source_dir=str(tmp_path / "catalog"))
    native = get_arm("dynamo").plan(arm_ctx(case, tmp_path, gpu_ids=("0",)))
    assert "workers" not in {p.role for p in native.processes}
    scripted = get_arm("dynamo").plan(replace(arm_ctx(case, tmp_path, gpu_ids=("0",)), workspace=checkout))
    (workers,) = [p for p in scripted.processes if p.role == "workers"]
    assert workers.argv[:2] == ("bash", str(script))
    assert workers.env["VLLM_DECODE_GRPC_PORT"] == str(scripted.ports["VLLM_DECODE_GRPC_PORT"])
    # The script pins each engine itself from these: both on the cell's one GPU.
    assert workers.env["VLLM_PREFILL_GPU"] == workers.env["VLLM_DECODE_GPU"] == "0"


def test_reference_plan(tmp_path: Path) -> None:
    case = arm_case("reference", {"faults": ["same-worker-id"], "slow_start_s": 2}, kv_bound=KvBound(bytes=4096))
    plan = get_arm("reference").plan(arm_ctx(case, tmp_path))
    prefill = plan.processes[0]
    assert prefill.argv[prefill.argv.index("--kv-cache-bytes") + 1] == "4096"
    assert prefill.env["MATRIX_REFERENCE_FAULTS"] == "same-worker-id"
    assert "--slow-start-s" in prefill.argv
    assert all(p.url.startswith("http://127.0.0.1:") for p in plan.ready_probes)


@pytest.mark.parametrize(("aggregated", "wanted"), [(False, (".generate", ".generate")), (True, (".generate",))])
def test_a_mocker_cell_is_ready_once_the_frontend_routes_to_every_worker(
    tmp_path: Path, aggregated: bool, wanted: tuple[str, ...]
) -> None:
    launch = {"engine": "mocker", "aggregated": aggregated}
    case = CaseInfo(name="m", backend="dynamo", arm="dynamo", model="m", markers=(), launch=launch)
    arm = get_arm("dynamo")
    ports = {request.name: 20000 + i for i, request in enumerate(arm.port_requests(case))}
    runtime = RuntimeInfo(backend="dynamo", version="1.6.1", tag="v1.6.1")
    plan = arm.plan(LaunchContext(cell_id="c", case=case, runtime=runtime, ports=ports, work_dir=tmp_path))
    (health,) = [p for p in plan.ready_probes if p.require_endpoints]
    assert health.url.endswith(f":{ports['frontend']}/health") and health.require_endpoints == wanted


@pytest.mark.parametrize(
    ("arm", "launch", "backend"),
    [("dynamo", {"engine": "mocker"}, "dynamo"), ("dynamo", SIDECAR_CASE, "dynamo"),
     ("vllm_native", {}, "vllm"), ("sglang_native", {}, "sglang")],
)  # fmt: skip
def test_engine_processes_get_the_loopback_knobs(
    tmp_path: Path, arm: str, launch: dict[str, object], backend: str
) -> None:
    # [M21] item 11: UCX (NIXL's transport) keeps to the loopback device; vLLM advertises 127.0.0.1.
    case = arm_case(arm, launch, kv_bound=KvBound(bytes=1119388000))
    case = dataclasses.replace(case, backend=backend)
    plan = get_arm(arm).plan(arm_ctx(case, tmp_path, gpu_ids=("0",)))
    engines = [p for p in plan.processes if p.role in ("prefill", "decode")]
    assert engines
    for process in engines:
        assert process.env["UCX_NET_DEVICES"] == "lo" and process.env["VLLM_HOST_IP"] == "127.0.0.1", process.role


def test_vllm_sidecar_on_two_gpus_puts_each_engine_on_upstreams_device(tmp_path: Path) -> None:
    """[M32] Upstream's layout (prefill on GPU 1, decode on GPU 0), with matrix's own plan and with the
    workspace's script, which pins each engine itself from VLLM_<ROLE>_GPU."""
    checkout = tmp_path / "dynamo"
    script = checkout / "lib" / "sidecar" / "vllm" / "launch" / "disagg.sh"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/bash\n")
    case = arm_case("dynamo", SIDECAR_CASE, kv_bound=KvBound(bytes=1119388000), source_dir=str(tmp_path / "catalog"))
    native = {p.role: p for p in get_arm("dynamo").plan(arm_ctx(case, tmp_path, gpu_ids=("2", "5"))).processes}
    assert native["prefill"].env["CUDA_VISIBLE_DEVICES"] == "5" and native["decode"].env["CUDA_VISIBLE_DEVICES"] == "2"
    scripted = get_arm("dynamo").plan(replace(arm_ctx(case, tmp_path, gpu_ids=("2", "5")), workspace=checkout))
    (workers,) = [p for p in scripted.processes if p.role == "workers"]
    assert (workers.env["VLLM_PREFILL_GPU"], workers.env["VLLM_DECODE_GPU"]) == ("5", "2")
