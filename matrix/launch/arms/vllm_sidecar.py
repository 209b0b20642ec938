"""Dynamo's native sidecar over vLLM's bundled `vllm-rs`: the system the sidecar tests exist for.

Five processes per cell: two engines (`vllm-rs serve`, each launching its own headless Python engine with
NixlConnector), one Dynamo sidecar per engine that registers it with the frontend over the engine's gRPC
port, and Dynamo's frontend. A sidecar starts only once its engine answers `/health`, so it never races
the engine's gRPC listener. Every port comes from the allocator; the KV cache is bounded absolutely
(`--kv-cache-memory-bytes`, with a tiny `--gpu-memory-utilization`, which vLLM checks first) because two
engines share one GPU. On a CPU host `vllm-rs` drives vLLM's CPU build with its KV buffer in host memory.
The decode engine's `/metrics` proves the KV really moved.
"""

from __future__ import annotations

from collections.abc import Mapping

from matrix.case_launch import DynamoLaunch, launch_as, or_default
from matrix.engines import ENGINES
from matrix.launch.arms.base import LaunchContext, cell_scratch, cell_tmp_dir, loopback_url, role_gpu_env
from matrix.launch.arms.sidecar import AGGREGATED_ROLE, sidecar_process
from matrix.launch.arms.vllm_native import DEFAULT_KV_COUNTERS, omp_binding, vllm_engine_flags
from matrix.launch.launch_plan import EngineGauges, HealthProbe, LifecycleSpec, MetricsCheck, ProcessSpec

ROLES = ("prefill", "decode")
ENGINE = ENGINES["dynamo-vllm"]
DEFAULT_MAX_MODEL_LEN = 2048


def _launch(ctx: LaunchContext) -> DynamoLaunch:
    return launch_as(ctx.case.launch, DynamoLaunch)


def _max_model_len(launch: DynamoLaunch) -> int:
    return or_default(launch.max_model_len, DEFAULT_MAX_MODEL_LEN)


def engine_port(role: str, kind: str) -> str:
    """The allocator's name of one engine port, as upstream's launch script reads it from the environment
    (`VLLM_PREFILL_GRPC_PORT`...), so the script mode and this plan share one port layout."""
    return f"VLLM_{role.upper()}_{kind}_PORT"


def port_role(role: str) -> str:
    """Whose allocated ports an engine uses: the aggregated twin's one engine takes decode's."""
    return "decode" if role == AGGREGATED_ROLE else role


def _engine(ctx: LaunchContext, role: str, base_env: Mapping[str, str], binding: Mapping[str, str]) -> ProcessSpec:
    launch = _launch(ctx)
    ports = port_role(role)
    http = ctx.ports[engine_port(ports, "HTTP")]
    argv = [
        "vllm-rs", "serve", str(ctx.model_dir or ctx.case.model),
        # The managed engine runs with the runtime's interpreter, not whichever python3 is first on PATH.
        "--python", ctx.python,
        "--host", "127.0.0.1",
        "--port", str(http),
        "--grpc-port", str(ctx.ports[engine_port(ports, "GRPC")]),
        "--max-model-len", str(_max_model_len(launch)),
        "--served-model-name", ctx.case.model,
        # "auto" picks parsers from the model's config; a tiny generated qwen3 has no <think> token for them.
        "--reasoning-parser", or_default(launch.reasoning_parser, "none"),
        "--tool-call-parser", or_default(launch.tool_call_parser, "none"),
        "--",
        # The aggregated twin moves no KV: no connector, as upstream's agg case.
        *vllm_engine_flags(ctx, ENGINE, None if role == AGGREGATED_ROLE else "kv_both"),
    ]  # fmt: skip
    argv += [str(a) for a in launch.extra_args or ()]
    env = {**base_env, **role_gpu_env(ctx, role),
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ctx.ports[engine_port(ports, "NIXL_SIDE_CHANNEL")])}  # fmt: skip
    if role in binding:
        env["VLLM_CPU_OMP_THREADS_BIND"] = binding[role]
    env.update({str(k): str(v) for k, v in (launch.role_env or {}).get(role, {}).items()})
    return ProcessSpec(role=role, argv=tuple(argv), env=env, health=(HealthProbe(loopback_url(http, "/health")),))


def vllm_sidecar_processes(
    ctx: LaunchContext, dynamo_env: Mapping[str, str], roles: tuple[str, ...] = ROLES
) -> tuple[ProcessSpec, ...]:
    """Both engines first, then their sidecars (each after its own engine); `roles` ("worker",) for the
    aggregated twin: one engine serving both phases behind one sidecar."""
    on_gpu = bool(ctx.gpu_ids)
    base_env = {
        **dynamo_env,
        **scratch_env(ctx),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    }
    if not on_gpu:
        base_env["VLLM_TARGET_DEVICE"] = "cpu"
    base_env.update({str(k): str(v) for k, v in (_launch(ctx).env or {}).items()})
    binding = {} if on_gpu else omp_binding(ctx.cpu_ids)
    if roles == (AGGREGATED_ROLE,) and not on_gpu:  # one engine: all the host's cores
        binding = {AGGREGATED_ROLE: ",".join(map(str, ctx.cpu_ids)) if len(ctx.cpu_ids) >= 2 else "nobind"}
    engines = tuple(_engine(ctx, role, base_env, binding) for role in roles)
    sidecars = (
        sidecar_process(ctx, role, "dynamo.vllm.sidecar", ctx.ports[engine_port(port_role(role), "GRPC")], dynamo_env)
        for role in roles
    )
    return (*engines, *sidecars)


def scratch_env(ctx: LaunchContext) -> dict[str, str]:
    """Temporary files and caches of the engines stay inside the cell and go with it (unless the runtime
    has persistent caches)."""
    return cell_scratch(ctx, {"TMPDIR": str(cell_tmp_dir(ctx)), "VLLM_CACHE_ROOT": str(ctx.work_dir / "vllm-cache")})


# Either proves decode took the prompt's KV from prefill: NIXL's transfer timings, or the prompt tokens the
# engine counted as coming from a KV transfer. vllm-rs 0.31.0 relays the second but leaves the NIXL
# histograms at 0 for the same transfer (seen on an H200: 96 of 96 prompt tokens from external_kv_transfer,
# none computed). The external prefix-cache hit counter is no proof: it grows when decode merely plans the
# load, also when the load then fails (vllm-rs 0.29.0).
SIDECAR_KV_COUNTERS = (*DEFAULT_KV_COUNTERS, 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}')


def decode_metrics(ctx: LaunchContext) -> MetricsCheck:
    kv_counters = _launch(ctx).kv_counters
    counters = tuple(str(c) for c in or_default(kv_counters, SIDECAR_KV_COUNTERS))
    url = loopback_url(ctx.ports[engine_port("decode", "HTTP")], "/metrics")
    return MetricsCheck(url, counters, "any", record=str(ctx.work_dir / "metrics-decode.prom"))


# Dynamo's frontend routes every request through its prefill worker first; nothing public starts a decode
# on its own, so the orphaned-decode check cannot be driven on the sidecar system.
ORPHAN_SKIP = ("Dynamo's frontend always asks a prefill worker first and exposes no decode-only request; "
               "vllm-rs's own HTTP server is not the path the sidecar drives, so no public API starts an "
               "orphaned decode here")  # fmt: skip


def lifecycle(ctx: LaunchContext, roles: tuple[str, ...] = ROLES) -> LifecycleSpec:
    """The streaming and cancel checks read every engine's vLLM gauges (vllm-rs serves them)."""
    engines = tuple(
        EngineGauges(role, loopback_url(ctx.ports[engine_port(port_role(role), "HTTP")], "/metrics")) for role in roles
    )
    max_len = _max_model_len(_launch(ctx))
    return LifecycleSpec(str(ctx.work_dir), engines=engines, orphan_skip=ORPHAN_SKIP,
                         cancel_max_tokens=max(16, min(1024, max_len - 128)))  # fmt: skip
