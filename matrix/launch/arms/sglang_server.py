"""One SGLang server of a P/D pair (`python -m sglang.launch_server`), shared by SGLang's own P/D arm and
Dynamo's SGLang sidecar.

Both servers of a pair share one GPU, so memory is bounded absolutely: the KV pool holds exactly the
case's `kv_bound.tokens` (`--max-total-tokens`, a cap below what SGLang would size from free memory), and
`--mem-fraction-static` is small, so what one server reserves does not depend on what the other took
first. Attention runs on Triton kernels and sampling on PyTorch: both compile nothing with nvcc (the GPU
wheelhouse leaves FlashInfer's precompiled kernels out), and both work on every SGLang version of the
catalog. Every port comes from the allocator, NCCL's too (SGLang otherwise picks one near its HTTP port).

KV-transfer proof: the prefill server observes `sglang:kv_transfer_latency_ms` once per request whose KV
it finished writing into decode's slots (never for its own start-up warm-up, nor for an aborted
transfer); decode in SGLang's P/D mode cannot compute a prompt itself, so a transfer it did not get ends
the request instead of being silently recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping

from matrix.case_launch import DynamoLaunch, SglangNativeLaunch, or_default
from matrix.cells import CaseInfo
from matrix.engines import ENGINES
from matrix.hardware.ports import PortRequest
from matrix.launch.arms.base import LOOPBACK_ENV, LaunchContext, cell_scratch, cell_tmp_dir, loopback_url
from matrix.launch.launch_plan import HealthProbe, MetricsCheck, ProcessSpec

ROLES = ("prefill", "decode")
ENGINE = ENGINES["sglang"]
DEFAULT_CONTEXT_LENGTH = 1024
BOOTSTRAP_PORT = "SGLANG_DISAGGREGATION_BOOTSTRAP_PORT"
KV_COUNTERS = ("sglang:kv_transfer_latency_ms_count",)


def server_launch(case: CaseInfo) -> SglangNativeLaunch | DynamoLaunch:
    """The case's table as an SGLang server reads it: sglang_native's own, or Dynamo's SGLang sidecar's."""
    launch = case.launch
    if not isinstance(launch, SglangNativeLaunch | DynamoLaunch):
        raise TypeError(f"an SGLang server cannot read a {type(launch).__name__}")
    return launch


def port_name(role: str, kind: str) -> str:
    """The allocator's name of one server port, as upstream's launch script reads it from the environment
    (`SGLANG_PREFILL_GRPC_PORT`...), so the script mode and matrix's own plans share one layout."""
    return f"SGLANG_{role.upper()}_{kind}_PORT"


def port_requests(*, grpc: bool) -> tuple[PortRequest, ...]:
    kinds = ("HTTP", "NCCL", "GRPC") if grpc else ("HTTP", "NCCL")
    return (*(PortRequest(port_name(role, kind)) for role in ROLES for kind in kinds), PortRequest(BOOTSTRAP_PORT))


def scratch_env(ctx: LaunchContext) -> dict[str, str]:
    """Temporary files (SGLang's IPC sockets, Prometheus' multiprocess files) and caches stay in the cell
    (the caches unless the runtime has persistent ones)."""
    return cell_scratch(
        ctx,
        {
            "TMPDIR": str(cell_tmp_dir(ctx)),
            "TRITON_CACHE_DIR": str(ctx.work_dir / "triton-cache"),
            "XDG_CACHE_HOME": str(ctx.work_dir / "cache"),
        },
    )


def server(
    ctx: LaunchContext, role: str, env: Mapping[str, str], *, grpc: bool, disaggregated: bool = True
) -> ProcessSpec:
    """The `role` server; `grpc` adds SGLang's native gRPC listener (what Dynamo's sidecar talks to);
    without `disaggregated` it is a plain aggregated server (the control case)."""
    launch = server_launch(ctx.case)
    http = ctx.ports[port_name(role, "HTTP")]
    argv = [
        ctx.python, "-m", "sglang.launch_server",
        "--model-path", str(ctx.model_dir or ctx.case.model),
        "--served-model-name", ctx.case.model,
        "--host", "127.0.0.1",
        "--port", str(http),
        "--nccl-port", str(ctx.ports[port_name(role, "NCCL")]),
        *ENGINE.kv_argv(ctx.case.kv_bound),
        "--context-length", str(or_default(launch.max_model_len, DEFAULT_CONTEXT_LENGTH)),
        "--max-running-requests", str(or_default(launch.max_running_requests, 8)),
        *ENGINE.fraction_argv(launch),
        "--attention-backend", or_default(launch.attention_backend, "triton"),
        "--sampling-backend", or_default(launch.sampling_backend, "pytorch"),
        "--enable-metrics",
    ]  # fmt: skip
    if launch.disable_cuda_graph is not False:
        argv.append("--disable-cuda-graph")
    if disaggregated:
        argv += [
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", or_default(launch.transfer_backend, "nixl"),
            "--disaggregation-bootstrap-port", str(ctx.ports[BOOTSTRAP_PORT]),
        ]  # fmt: skip
    if grpc:
        # Dynamo's sidecar refuses a server that re-sends the whole text with every streamed chunk.
        argv += ["--grpc-port", str(ctx.ports[port_name(role, "GRPC")]), "--incremental-streaming-output"]
    argv += [str(a) for a in launch.extra_args or ()]
    role_env = {
        **LOOPBACK_ENV,
        **env,
        # SGLang's KV-transfer side channels bind the address it detects as "local" (a routable interface
        # when there is one); the pair talks over loopback only.
        "SGLANG_HOST_IP": "127.0.0.1",
        # By default `/health` runs a one-token generation per call: behind matrix's proxy, which asks both
        # servers, the readiness probe never got an answer in time (300 s on an H200). Without it `/health`
        # answers 503 while the server starts and 200 once it serves.
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
    }
    role_env.update({str(k): str(v) for k, v in (launch.role_env or {}).get(role, {}).items()})
    return ProcessSpec(role=role, argv=tuple(argv), env=role_env, health=(HealthProbe(loopback_url(http, "/health")),))


def kv_metrics(ctx: LaunchContext) -> MetricsCheck:
    """Prefill's completed KV transfers must grow during the request; the scrape is kept with the logs."""
    counters = tuple(str(c) for c in or_default(server_launch(ctx.case).kv_counters, KV_COUNTERS))
    url = loopback_url(ctx.ports[port_name("prefill", "HTTP")], "/metrics")
    return MetricsCheck(url, counters, record=str(ctx.work_dir / "metrics-prefill.prom"))
