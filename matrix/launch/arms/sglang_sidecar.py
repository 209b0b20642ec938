"""Dynamo's native sidecar over SGLang: the seed's SGLang row.

Five processes per cell: two SGLang servers (prefill and decode, P/D over NIXL, each with its native gRPC
listener beside HTTP), one `python -m dynamo.sglang.sidecar` per server that registers it with Dynamo's
frontend over that gRPC port, and the frontend. A sidecar starts once its server answers `/health`. The
sidecar hands decode the prefill server's bootstrap address; discovery here is loopback only, so it is
told the host (`--bootstrap-host`) rather than left to guess a routable one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from matrix.launch.arms import sglang_server
from matrix.launch.arms.base import LaunchContext
from matrix.launch.arms.sidecar import AGGREGATED_ROLE, sidecar_process
from matrix.launch.launch_plan import ProcessSpec

SIDECAR_MODULE = "dynamo.sglang.sidecar"


def sglang_sidecar_processes(
    ctx: LaunchContext, dynamo_env: Mapping[str, str], roles: tuple[str, ...] = sglang_server.ROLES
) -> tuple[ProcessSpec, ...]:
    """Both servers first, then their sidecars (each after its own server); `roles` ("worker",) for the
    aggregated twin: one plain server (decode's ports) behind one sidecar."""
    env = {**dynamo_env, **sglang_server.scratch_env(ctx)}
    env.update({str(k): str(v) for k, v in (sglang_server.server_launch(ctx.case).env or {}).items()})
    if roles == (AGGREGATED_ROLE,):
        plain = sglang_server.server(ctx, "decode", env, grpc=True, disaggregated=False)
        grpc = ctx.ports[sglang_server.port_name("decode", "GRPC")]
        sidecar = sidecar_process(ctx, AGGREGATED_ROLE, SIDECAR_MODULE, grpc, dynamo_env)
        return (replace(plain, role=AGGREGATED_ROLE), sidecar)
    servers = tuple(sglang_server.server(ctx, role, env, grpc=True) for role in roles)
    sidecars = tuple(
        sidecar_process(
            ctx,
            role,
            SIDECAR_MODULE,
            ctx.ports[sglang_server.port_name(role, "GRPC")],
            dynamo_env,
            ("--bootstrap-host", "127.0.0.1"),
        )
        for role in roles
    )
    return (*servers, *sidecars)
