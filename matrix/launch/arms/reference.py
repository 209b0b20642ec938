"""The built-in reference pair: `python -m matrix.reference` frontend, prefill worker and decode worker."""

from __future__ import annotations

from matrix.case_launch import ReferenceLaunch, launch_as, peer_loss_options
from matrix.cells import CaseInfo
from matrix.check.specs import MetricsCheck, PeerLossSpec, TopologySpec, TopologyWorker
from matrix.engines import ENGINES
from matrix.hardware.ports import PortRequest
from matrix.launch.arms import topology as topology_names
from matrix.launch.arms.base import (
    LaunchContext,
    gpu_env,
    loopback_url,
    oracle_spec,
    served_plan,
)  # fmt: skip
from matrix.launch.launch_plan import EngineGauges, HealthProbe, LaunchPlan, LifecycleSpec, ProcessSpec

ENGINE = ENGINES["reference"]
PORTS = ("frontend", "prefill_http", "prefill_side_channel", "decode_http", "decode_side_channel")
# The aggregated deployment (the oracle's baseline): one worker doing both phases, and a frontend.
AGGREGATED_PORTS = ("aggregated_frontend", "aggregated_http", "aggregated_side_channel")


class ReferenceArm:
    name = "reference"

    def port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]:
        extra = [f"{name}_{kind}" for name in worker_names(case)[2:] for kind in ("http", "side_channel")]
        return tuple(PortRequest(name) for name in (*PORTS, *extra))

    def runs_on_cpu(self, case: CaseInfo) -> bool:
        return case.runs_on_cpu  # the arm table's word: `launch.device`, "cpu" by default (`arm_table.ARM_ROWS`)

    def absolute_memory(self, case: CaseInfo) -> bool:
        # The workers allocate exactly their KV bytes; without a bound a case sizes nothing absolutely.
        return case.absolute_memory

    def aggregated_port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]:
        return tuple(PortRequest(name) for name in AGGREGATED_PORTS)

    def _env(self, ctx: LaunchContext) -> dict[str, str]:
        env = {**ctx.env, **gpu_env(ctx), "PYTHONUNBUFFERED": "1"}
        faults = [str(f) for f in launch_as(ctx.case.launch, ReferenceLaunch).faults or ()]
        if faults:
            env["MATRIX_REFERENCE_FAULTS"] = ",".join(faults)
            # Shared by every attempt of this case in this campaign (work dirs are per attempt).
            env["MATRIX_REFERENCE_STATE"] = str(ctx.work_dir.parent / f"{ctx.case.name}.reference-state")
        return env

    def _worker(self, ctx: LaunchContext, role: str, env: dict[str, str], name: str = "") -> ProcessSpec:
        """Worker `name` (its process role and ports: "decode", "decode_2"...) running as `role`."""
        name = name or role
        launch = launch_as(ctx.case.launch, ReferenceLaunch)
        device = "cuda" if ctx.gpu_ids and launch.device == "cuda" else "cpu"
        argv = [
            ctx.python, "-m", "matrix.reference", "worker", "--role", role,
            "--port", str(ctx.ports[f"{name}_http"]),
            "--side-channel-port", str(ctx.ports[f"{name}_side_channel"]),
            *ENGINE.kv_argv(ctx.case.kv_bound),
            "--device", device,
        ]  # fmt: skip
        if launch.slow_start_s is not None:
            argv += ["--slow-start-s", str(launch.slow_start_s)]
        if launch.token_delay_ms is not None:
            argv += ["--token-delay-ms", str(launch.token_delay_ms)]
        if launch.kv_ttl_s is not None:
            argv += ["--kv-ttl-s", str(launch.kv_ttl_s)]
        health = (HealthProbe(loopback_url(ctx.ports[f"{name}_http"], "/health")),)
        return ProcessSpec(role=name, argv=tuple(argv), env=env, health=health)

    def aggregated_plan(self, ctx: LaunchContext) -> LaunchPlan:
        """One `--role aggregated` worker (both phases, its own pool, no transfer) behind a frontend."""
        env = self._env(ctx)
        port = ctx.ports["aggregated_frontend"]
        argv = (
            ctx.python, "-m", "matrix.reference", "frontend",
            "--port", str(port),
            "--aggregated-url", loopback_url(ctx.ports["aggregated_http"]),
            "--model", ctx.case.model,
        )  # fmt: skip
        frontend = ProcessSpec(
            role="aggregated_frontend",
            argv=argv,
            env=env,
            health=(HealthProbe(loopback_url(port, "/live")),),
        )
        return served_plan(
            ctx,
            port,
            (self._worker(ctx, "aggregated", env), frontend),
            grace_s=3.0,
            oracle=oracle_spec(ctx, port),
        )

    def plan(self, ctx: LaunchContext) -> LaunchPlan:
        env = self._env(ctx)
        base = (ctx.python, "-m", "matrix.reference")
        names = worker_names(ctx.case)
        workers = [self._worker(ctx, name.split("_")[0], env, name) for name in names]
        upstreams = [(f"--{name.split('_')[0]}-url", loopback_url(ctx.ports[f"{name}_http"])) for name in names]
        frontend_port = ctx.ports["frontend"]
        frontend = ProcessSpec(
            role="frontend",
            argv=(
                *base,
                "frontend",
                "--port",
                str(frontend_port),
                *(part for pair in upstreams for part in pair),
                "--model",
                ctx.case.model,
            ),
            env=env,
            health=(HealthProbe(loopback_url(frontend_port, "/live")),),
        )
        return served_plan(
            ctx,
            frontend_port,
            (*workers, frontend),
            grace_s=3.0,
            metrics_checks=(decode_metrics(ctx),),
            oracle=oracle_spec(ctx, frontend_port),
            lifecycle=lifecycle(ctx),
            topology=topology(ctx) if launch_as(ctx.case.launch, ReferenceLaunch).topology is not None else None,
            peer_loss=peer_loss(ctx),
        )


def worker_names(case: CaseInfo) -> tuple[str, ...]:
    """The workers of the case's topology, prefills first (`arms.topology.worker_names`)."""
    return topology_names.worker_names(launch_as(case.launch, ReferenceLaunch).topology)


def topology(ctx: LaunchContext) -> TopologySpec:
    """Every worker of the xPyD topology, for the check that each served and moved KV (`check.topology`)."""
    workers = tuple(
        TopologyWorker(
            name,
            name.split("_")[0],
            loopback_url(ctx.ports[f"{name}_http"], "/health"),
            loopback_url(ctx.ports[f"{name}_http"], "/metrics"),
        )
        for name in worker_names(ctx.case)
    )
    return TopologySpec(launch_as(ctx.case.launch, ReferenceLaunch).topology or "1p1d", workers, str(ctx.work_dir))


def peer_loss(ctx: LaunchContext) -> PeerLossSpec | None:
    """The case's peer-loss check over every worker of its topology (`check.peer_loss`), or None."""
    options = peer_loss_options(launch_as(ctx.case.launch, ReferenceLaunch).peer_loss)
    if options is None:
        return None
    workers = topology(ctx).workers
    gauges = tuple(EngineGauges(w.name, w.metrics_url, *REFERENCE_GAUGES) for w in workers)
    return PeerLossSpec(str(ctx.work_dir), workers, gauges, **options)


def lifecycle(ctx: LaunchContext) -> LifecycleSpec:
    """Streaming, cancel and orphaned-decode checks on the workers' own gauges; the reference releases a
    dropped request at once, so its bound is short (the faults that hold one fail within it)."""
    engines = tuple(
        EngineGauges(role, loopback_url(ctx.ports[f"{role}_http"], "/metrics"), *REFERENCE_GAUGES)
        for role in ("prefill", "decode")
    )
    return LifecycleSpec(
        str(ctx.work_dir),
        engines=engines,
        orphan_url=loopback_url(ctx.ports["decode_http"], "/decode"),
        orphan_protocol="reference",
        bound_s=10.0,
    )


REFERENCE_GAUGES = (
    "matrix_reference:num_requests_running",
    "matrix_reference:num_requests_waiting",
    "matrix_reference:kv_cache_usage_perc",
)


def decode_metrics(ctx: LaunchContext) -> MetricsCheck:
    """Decode's KV counters, scraped around the request for the KV ledger only: no counter is required to
    grow (the reference pair proves its transfer by checksum), so every verdict stays as it was."""
    url = loopback_url(ctx.ports["decode_http"], "/metrics")
    return MetricsCheck(url, (), record=str(ctx.work_dir / "metrics-decode.prom"))
