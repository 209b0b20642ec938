"""Launch plans of the arms are pure data: built and checked here without starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.errors import ConfigError
from matrix.launch.arms import get_arm, known_arms
from matrix.launch.arms.base import LaunchContext
from matrix.launch.arms.dynamo import ENGINE_PORTS, SYSTEM_PORT_MAX
from matrix.markers import parse_marker_use
from matrix.plan import CaseInfo, RuntimeInfo


def _case(arm: str, launch: dict[str, object], **kw: object) -> CaseInfo:
    markers = ("gpu_1",)
    return CaseInfo(
        name="c", backend="vllm", arm=arm, model="Qwen/Qwen3-0.6B", markers=tuple(map(parse_marker_use, markers)),
        launch=launch, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _ctx(case: CaseInfo, tmp_path: Path, gpu_ids: tuple[str, ...] = ()) -> LaunchContext:
    arm = get_arm(case.arm)
    ports = {req.name: 20000 + i for i, req in enumerate(arm.port_requests(case))}
    runtime = RuntimeInfo(backend=case.backend, version="0.30.0", tag="v0.30.0")
    return LaunchContext("cell1", case, runtime, ports, tmp_path, python="/py", gpu_ids=gpu_ids, model_dir=tmp_path)


def test_registry_is_explicit_and_unknown_arms_fail_before_anything_starts() -> None:
    assert known_arms() == {"reference", "dynamo", "vllm_native"}
    with pytest.raises(ConfigError, match="unknown arm 'sidecar'; known arms: dynamo, reference, vllm_native"):
        get_arm("sidecar")


def test_unknown_dynamo_engine_fails_loudly() -> None:
    with pytest.raises(ConfigError, match="unknown dynamo engine 'trt'"):
        get_arm("dynamo").port_requests(_case("dynamo", {"engine": "trt"}))


def test_mocker_plan(tmp_path: Path) -> None:
    case = _case("dynamo", {"engine": "mocker"})
    requests = {r.name: r.max_port for r in get_arm("dynamo").port_requests(case)}
    assert requests["prefill_system"] == requests["decode_system"] == SYSTEM_PORT_MAX  # parsed as i16 upstream
    plan = get_arm("dynamo").plan(_ctx(case, tmp_path))
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
    frontend = plan.processes[2]
    assert "--http-host" in frontend.argv and frontend.argv[frontend.argv.index("--http-host") + 1] == "127.0.0.1"
    assert plan.ready_probes[0].require_models


def test_aggregated_control_has_one_worker(tmp_path: Path) -> None:
    case = _case("dynamo", {"engine": "mocker", "aggregated": True})
    plan = get_arm("dynamo").plan(_ctx(case, tmp_path))
    assert [p.role for p in plan.processes] == ["worker", "frontend"]
    assert "--disaggregation-mode" not in plan.processes[0].argv


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_gpu_engines_get_their_ports_and_pins_through_the_script_environment(tmp_path: Path, engine: str) -> None:
    script = tmp_path / "lib" / "sidecar" / engine / "launch" / "disagg.sh"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/bash\n")
    case = _case(
        "dynamo", {"engine": engine, "script": f"lib/sidecar/{engine}/launch/disagg.sh"}, source_dir=str(tmp_path)
    )
    plan = get_arm("dynamo").plan(_ctx(case, tmp_path, gpu_ids=("3",)))
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
    case = _case("dynamo", {"engine": engine, "script": "disagg.sh", **launch}, source_dir=str(tmp_path),
                 kv_bound=bound)  # fmt: skip
    (workers,) = [
        p for p in get_arm("dynamo").plan(_ctx(case, tmp_path, gpu_ids=("0",))).processes if p.role == "workers"
    ]
    assert workers.argv == ("bash", str(script), *args)
    assert env.items() <= dict(workers.env).items()


def test_launch_scripts_resolve_against_the_workspace(tmp_path: Path) -> None:
    checkout = tmp_path / "dynamo"
    (checkout / "lib").mkdir(parents=True)
    (checkout / "lib" / "disagg.sh").write_text("#!/bin/bash\n")
    case = _case("dynamo", {"engine": "vllm", "script": "lib/disagg.sh"}, source_dir=str(tmp_path / "catalog"))
    with pytest.raises(ConfigError, match=r"launch script lib/disagg\.sh not found .* --workspace"):
        get_arm("dynamo").plan(_ctx(case, tmp_path))
    ctx = _ctx(case, tmp_path)
    from dataclasses import replace

    plan = get_arm("dynamo").plan(replace(ctx, workspace=checkout))
    assert plan.processes[0].argv[1] == str(checkout / "lib" / "disagg.sh")


def test_gpu_engine_without_a_script_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs launch\.script"):
        get_arm("dynamo").plan(_ctx(_case("dynamo", {"engine": "vllm"}), tmp_path))


def test_reference_plan(tmp_path: Path) -> None:
    case = _case("reference", {"faults": ["same-worker-id"], "slow_start_s": 2}, kv_bound={"bytes": 4096})
    plan = get_arm("reference").plan(_ctx(case, tmp_path))
    prefill = plan.processes[0]
    assert prefill.argv[prefill.argv.index("--kv-cache-bytes") + 1] == "4096"
    assert prefill.env["MATRIX_REFERENCE_FAULTS"] == "same-worker-id"
    assert "--slow-start-s" in prefill.argv
    assert all(p.url.startswith("http://127.0.0.1:") for p in plan.ready_probes)
