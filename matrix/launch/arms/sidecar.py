"""One Dynamo native sidecar: registers an engine that runs in its own process with Dynamo's frontend,
talking to the engine over its gRPC port. The same shape for every engine; the module and its extra
arguments differ (`dynamo.vllm.sidecar`, `dynamo.sglang.sidecar`)."""

from __future__ import annotations

from collections.abc import Mapping

from matrix.launch.arms.base import LaunchContext, loopback_url
from matrix.launch.launch_plan import HealthProbe, ProcessSpec

# The role of the one engine (and its sidecar) of an aggregated twin: it serves both phases.
AGGREGATED_ROLE = "worker"


def sidecar_process(
    ctx: LaunchContext, role: str, module: str, grpc_port: int, dynamo_env: Mapping[str, str],
    extra_args: tuple[str, ...] = (),
) -> ProcessSpec:  # fmt: skip
    """The sidecar of the `role` engine; it starts once that engine answers its health probe, since it
    connects to the engine's gRPC port at start."""
    system_port = ctx.ports[f"{role}_system"]
    argv = [ctx.python, "-m", module, "--grpc-endpoint", f"127.0.0.1:{grpc_port}"]
    if role == "prefill":
        argv += ["--component", "prefill"]
    # The aggregated twin's one engine and sidecar are the `worker`: Dynamo's mode for it is `agg`.
    argv += ["--disaggregation-mode", "agg" if role == AGGREGATED_ROLE else role, *extra_args]
    env = {
        **dynamo_env,
        "DYN_SYSTEM_PORT": str(system_port),
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
        # On SIGTERM a sidecar waits 5 s, then (prefill) up to 25 s for its engine to report no KV transfer
        # in flight, which the sidecar cannot tell: it always waits the whole budget. Teardown comes after
        # the cell's only request has finished, so there is nothing left to drain.
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "1",
        "DYN_PREFILL_DRAIN_TIMEOUT_S": "2",
    }
    return ProcessSpec(
        role=f"{role}_sidecar",
        argv=tuple(argv),
        env=env,
        health=(HealthProbe(loopback_url(system_port, "/health")),),
        start_after=(role,),
    )
