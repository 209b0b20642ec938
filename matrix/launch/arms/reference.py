"""The built-in reference pair: `python -m matrix.reference` frontend, prefill worker and decode worker."""

from __future__ import annotations

from matrix.hardware.ports import PortRequest
from matrix.launch.arms.base import LaunchContext, chat_request, frontend_probes, gpu_env, loopback_url
from matrix.launch.plan import HealthProbe, LaunchPlan, ProcessSpec
from matrix.plan import CaseInfo

DEFAULT_KV_CACHE_BYTES = 8 * 1024 * 1024
PORTS = ("frontend", "prefill_http", "prefill_side_channel", "decode_http", "decode_side_channel")


class ReferenceArm:
    name = "reference"

    def port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]:
        return tuple(PortRequest(name) for name in PORTS)

    def runs_on_cpu(self, case: CaseInfo) -> bool:
        return str(case.launch.get("device", "cpu")) == "cpu"

    def absolute_memory(self, case: CaseInfo) -> bool:
        # The workers allocate exactly --kv-cache-bytes; without a bound a case sizes nothing absolutely.
        return "bytes" in case.kv_bound

    def plan(self, ctx: LaunchContext) -> LaunchPlan:
        launch = ctx.case.launch
        kv_bytes = int(ctx.case.kv_bound.get("bytes", DEFAULT_KV_CACHE_BYTES))
        device = "cuda" if ctx.gpu_ids and launch.get("device") == "cuda" else "cpu"
        env = {**ctx.env, **gpu_env(ctx), "PYTHONUNBUFFERED": "1"}
        faults = [str(f) for f in launch.get("faults", [])]
        if faults:
            env["MATRIX_REFERENCE_FAULTS"] = ",".join(faults)
            # Shared by every attempt of this case in this campaign (work dirs are per attempt).
            env["MATRIX_REFERENCE_STATE"] = str(ctx.work_dir.parent / f"{ctx.case.name}.reference-state")
        base = (ctx.python, "-m", "matrix.reference")
        workers = []
        for role in ("prefill", "decode"):
            argv = [
                *base, "worker", "--role", role,
                "--port", str(ctx.ports[f"{role}_http"]),
                "--side-channel-port", str(ctx.ports[f"{role}_side_channel"]),
                "--kv-cache-bytes", str(kv_bytes),
                "--device", device,
            ]  # fmt: skip
            if "slow_start_s" in launch:
                argv += ["--slow-start-s", str(launch["slow_start_s"])]
            if "token_delay_ms" in launch:
                argv += ["--token-delay-ms", str(launch["token_delay_ms"])]
            health = (HealthProbe(loopback_url(ctx.ports[f"{role}_http"], "/health")),)
            workers.append(ProcessSpec(role=role, argv=tuple(argv), env=env, health=health))
        frontend_port = ctx.ports["frontend"]
        frontend = ProcessSpec(
            role="frontend",
            argv=(
                *base,
                "frontend",
                "--port",
                str(frontend_port),
                "--prefill-url",
                loopback_url(ctx.ports["prefill_http"]),
                "--decode-url",
                loopback_url(ctx.ports["decode_http"]),
                "--model",
                ctx.case.model,
            ),
            env=env,
            health=(HealthProbe(loopback_url(frontend_port, "/live")),),
        )
        return LaunchPlan(
            cell_id=ctx.cell_id,
            processes=(*workers, frontend),
            ready_probes=frontend_probes(frontend_port),
            request=chat_request(ctx, frontend_port),
            ports=dict(ctx.ports),
            startup_timeout_s=ctx.case.startup_timeout_s,
            teardown_grace_s=float(launch.get("teardown_grace_s", 3.0)),
            gpu_ids=ctx.gpu_ids,
        )
