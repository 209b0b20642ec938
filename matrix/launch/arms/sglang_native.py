"""SGLang's own disaggregated path: a prefill and a decode server joined by NIXL, matrix's P/D proxy in
front speaking SGLang's router protocol (the request goes to both at once with a shared bootstrap room).

Both servers are pinned to the cell's GPU with absolute KV bounds (`sglang_server`). The control variant
(`launch.aggregated_servers`) runs two plain servers: distinct workers still answer, nothing moves between
them, and only the kv_transfer check can tell.
"""

from __future__ import annotations

from matrix.case_launch import SglangNativeLaunch, launch_as
from matrix.cells import CaseInfo
from matrix.hardware.ports import PortRequest
from matrix.launch.arms import sglang_server
from matrix.launch.arms.base import LaunchContext, gpu_env, pd_proxy, served_plan
from matrix.launch.launch_plan import LaunchPlan


class SglangNativeArm:
    name = "sglang_native"

    def port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]:
        return (PortRequest("proxy"), *sglang_server.port_requests(grpc=False))

    def runs_on_cpu(self, case: CaseInfo) -> bool:
        return case.runs_on_cpu  # the arm table's word: never (`arm_table.ARM_ROWS`)

    def absolute_memory(self, case: CaseInfo) -> bool:
        # An explicit token pool (`kv_bound.tokens`) and a tiny `--mem-fraction-static` (the arm table's word).
        return case.absolute_memory

    def plan(self, ctx: LaunchContext) -> LaunchPlan:
        launch = launch_as(ctx.case.launch, SglangNativeLaunch)
        scratch = sglang_server.scratch_env(ctx)
        env = {**ctx.env, **gpu_env(ctx), **scratch, "PYTHONUNBUFFERED": "1"}
        env.update({str(k): str(v) for k, v in (launch.env or {}).items()})
        disaggregated = not launch.aggregated_servers
        servers = tuple(
            sglang_server.server(ctx, role, env, grpc=False, disaggregated=disaggregated)
            for role in sglang_server.ROLES
        )
        http = {role: ctx.ports[sglang_server.port_name(role, "HTTP")] for role in sglang_server.ROLES}
        proxy_port = ctx.ports["proxy"]
        bootstrap = str(ctx.ports[sglang_server.BOOTSTRAP_PORT])
        proxy = pd_proxy(ctx, http["prefill"], http["decode"], "--protocol", "sglang", "--bootstrap-port", bootstrap)
        return served_plan(
            ctx,
            proxy_port,
            (*servers, proxy),
            grace_s=15.0,
            metrics_checks=(sglang_server.kv_metrics(ctx),),
            scratch_dirs=tuple(scratch.values()),
        )
