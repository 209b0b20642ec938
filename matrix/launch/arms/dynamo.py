"""Dynamo: a frontend plus a prefill and a decode worker, discovered through files, talking over TCP.

Engines: `mocker` runs the workers as `python -m dynamo.mocker` (CPU only); `vllm` runs Dynamo's native
sidecar over two `vllm-rs` engines as matrix's own five-process plan (`vllm_sidecar`), on a GPU or, with
`launch.cpu`, over vLLM's CPU build; `sglang` runs it over two SGLang servers (`sglang_sidecar`). A case
may instead name an upstream launch script: `launch.script` always runs it; `launch.workspace_script`
runs it when `matrix run --workspace DIR` gives a checkout. The script reads its ports and GPU from the
environment and resolves against the workspace or the case's declared directory. trtllm runs through its
script only.
"""

from __future__ import annotations

from pathlib import Path

from matrix.arm_table import ARM_ROWS
from matrix.case_launch import DynamoLaunch, launch_as, or_default, peer_loss_options
from matrix.cells import CaseInfo
from matrix.check.specs import EngineGauges, PeerLossSpec, TopologySpec, TopologyWorker
from matrix.errors import ConfigError
from matrix.hardware.ports import PortRequest
from matrix.launch.arms import sglang_server
from matrix.launch.arms.base import (
    LOOPBACK_ENV,
    ROLE_DEVICE,
    LaunchContext,
    cell_scratch,
    cell_tmp_dir,
    chat_request,
    frontend_probes,
    gpu_env,
    loopback_url,
)
from matrix.launch.arms.sglang_sidecar import sglang_sidecar_processes
from matrix.launch.arms.sidecar import AGGREGATED_ROLE
from matrix.launch.arms.topology import role_of, worker_names
from matrix.launch.arms.vllm_sidecar import decode_metrics, scratch_env, vllm_sidecar_processes
from matrix.launch.arms.vllm_sidecar import lifecycle as vllm_lifecycle
from matrix.launch.launch_plan import HealthProbe, LaunchPlan, LifecycleSpec, LogSettle, MetricsCheck, ProcessSpec

# Dynamo parses DYN_SYSTEM_PORT as a signed 16-bit integer.
SYSTEM_PORT_MAX = 32767

# Engine ports per backend, as the upstream sidecar launch scripts read them.
ENGINE_PORTS: dict[str, tuple[str, ...]] = {
    "mocker": (),
    "vllm": (
        "VLLM_PREFILL_HTTP_PORT", "VLLM_PREFILL_GRPC_PORT", "VLLM_DECODE_HTTP_PORT", "VLLM_DECODE_GRPC_PORT",
        "VLLM_PREFILL_NIXL_SIDE_CHANNEL_PORT", "VLLM_DECODE_NIXL_SIDE_CHANNEL_PORT", "VLLM_PREFILL_KV_EVENT_PORT",
    ),
    "sglang": tuple(request.name for request in sglang_server.port_requests(grpc=True)),
    "trtllm": ("TRTLLM_PREFILL_GRPC_PORT", "TRTLLM_DECODE_GRPC_PORT"),
}  # fmt: skip


def _launch(case: CaseInfo) -> DynamoLaunch:
    return launch_as(case.launch, DynamoLaunch)


def _engine(case: CaseInfo) -> str:
    engine = or_default(_launch(case).engine, "mocker")
    if engine not in ENGINE_PORTS:
        # Explicit dispatch: an unknown engine fails before anything starts (upstream once hit
        # KeyError: 'trtllm' from a name-suffix rule).
        raise ConfigError(
            f"case {case.name!r}: unknown dynamo engine {engine!r}; known engines: {', '.join(ENGINE_PORTS)}"
        )
    return engine


def kv_bound_args(engine: str, case: CaseInfo) -> tuple[str, ...]:
    """Engine flags that bound the KV cache absolutely (bytes or blocks, not a fraction), forwarded by the launch
    script to both workers: fractions are racy when two engines share a GPU, absolute caps are not."""
    launch, entry = _launch(case), ARM_ROWS["dynamo"].entry(engine)
    arg = entry.kv_arg(case.kv_bound) if entry is not None else None
    if entry is None or arg is None or engine == "trtllm":
        return ()
    flag, value = arg
    if engine == "vllm":
        # vLLM checks the memory fraction before the byte cap, so the fraction must be tiny too.
        return (flag, str(value), *entry.fraction_argv(launch))
    graph = ("--disable-cuda-graph",) if launch.disable_cuda_graph is not False else ()
    return (flag, str(value), *graph)


def kv_bound_env(engine: str, case: CaseInfo) -> dict[str, str]:
    env = {}
    max_model_len = _launch(case).max_model_len
    if max_model_len is not None:
        env["MAX_MODEL_LEN"] = str(max_model_len)
    entry = ARM_ROWS["dynamo"].entry(engine)
    if engine == "trtllm" and entry is not None and (arg := entry.kv_arg(case.kv_bound)) is not None:
        # TensorRT-LLM takes its KV bound from the engine config (kv_cache_config.max_tokens); the launch
        # script writes that config, so the bound travels as a variable.
        env[arg[0]] = str(arg[1])
    return env


def _response_stream_host(case: CaseInfo) -> str:
    """The loopback interface (`lo`), or the case's `response_stream_host`, which must stay on loopback."""
    host = or_default(_launch(case).response_stream_host, "lo")
    if host not in ("lo", "127.0.0.1", "localhost"):
        raise ConfigError(
            f"case {case.name}: response_stream_host {host!r} would leave loopback; use lo, 127.0.0.1 or localhost"
        )
    return host


def _worker_roles(case: CaseInfo) -> tuple[str, ...]:
    """Two workers for a disaggregated case (or a topology's: "prefill", "decode", "prefill_2"..., mocker
    only, `case_launch`); one for an aggregated twin or control (which must fail the distinct-workers check)."""
    launch = _launch(case)
    return (AGGREGATED_ROLE,) if launch.aggregated else worker_names(launch.topology)


def _script_text(ctx: LaunchContext) -> str | None:
    """The launch script this attempt runs, if any: `script` always, `workspace_script` with --workspace."""
    launch = _launch(ctx.case)
    if launch.script:
        return launch.script
    if ctx.workspace is not None and launch.workspace_script:
        return launch.workspace_script
    return None


class DynamoArm:
    name = "dynamo"

    def port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]:
        engine = _engine(case)
        return (
            PortRequest("frontend"),
            *(PortRequest(f"{role}_system", max_port=SYSTEM_PORT_MAX) for role in _worker_roles(case)),
            *(PortRequest(name) for name in ENGINE_PORTS[engine]),
        )

    def runs_on_cpu(self, case: CaseInfo) -> bool:
        _engine(case)  # an engine the arm does not run fails here, loudly
        return case.runs_on_cpu  # the arm table's word (`arm_table.ARM_ROWS["dynamo"]`)

    def absolute_memory(self, case: CaseInfo) -> bool:
        # A launch script may start its engines any way it likes: only matrix's own plans are vouched for
        # (the row's `vouched`; trtllm runs through its script only, its entry is never vouched for).
        return case.absolute_memory

    def plan(self, ctx: LaunchContext) -> LaunchPlan:
        engine = _engine(ctx.case)
        ports = ctx.ports
        # Dynamo writes a logging configuration into the temporary directory at every start-up and never
        # removes it (a hundred files a grid): TMPDIR is the cell's, removed with it.
        tmp = cell_scratch(ctx, {"TMPDIR": str(cell_tmp_dir(ctx))})
        env = {
            **LOOPBACK_ENV,
            **ctx.env,
            **tmp,
            **gpu_env(ctx),
            "PYTHONUNBUFFERED": "1",
            "DYN_NAMESPACE": f"matrix-{ctx.cell_id}",
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(ctx.work_dir / "discovery"),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            # An interface name, not an address: ai-dynamo < 1.6 reads this variable as an interface and
            # fails every request route with "Interface not found: 127.0.0.1"; 1.6 accepts both. A case
            # may give an address instead (`response_stream_host`) to show which releases accept one.
            "DYN_TCP_RESPONSE_STREAM_HOST": _response_stream_host(ctx.case),
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1",
            # The frontend keeps a cache under the user's cache directory; keep it inside the cell.
            "XDG_CACHE_HOME": str(ctx.work_dir / "cache"),
        }
        frontend_port = ports["frontend"]
        frontend = ProcessSpec(
            role="frontend",
            argv=(
                ctx.python,
                "-m",
                "dynamo.frontend",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(frontend_port),
            ),
            env=env,
            # /health lists a prefill worker's endpoint before the frontend's prefill router for it is active:
            # a request in between got 503 (1.6.1). Ready waits for the activation it announced.
            settles=(LogSettle(r"activating prefill router", r"[Pp]refill router target activated"),),
        )
        metrics: tuple[MetricsCheck, ...] = ()
        lifecycle: LifecycleSpec | None = None
        topology: TopologySpec | None = None
        peer_loss: PeerLossSpec | None = None
        scratch = [env["DYN_FILE_KV"], env["XDG_CACHE_HOME"], *tmp.values()]
        script = _script_text(ctx)
        ready = frontend_probes(frontend_port)
        if engine == "mocker":
            workers = tuple(self._mocker(ctx, role, env) for role in _worker_roles(ctx.case))
            # The frontend lists the model and says healthy once *one* worker registered; a request then
            # fails 503 "no backend worker available" until it has discovered the prefill worker too.
            # Ready means its /health lists a generate instance per worker (counted, not named: the components'
            # names, "prefill" and "backend" in 1.6.1, are Dynamo's to change).
            wanted = tuple(".generate" for _ in _worker_roles(ctx.case))
            ready += (HealthProbe(loopback_url(frontend_port, "/health"), require_endpoints=wanted),)
            topology, peer_loss = mocker_topology(ctx), mocker_peer_loss(ctx)
        elif script is None and engine == "vllm":
            roles = _worker_roles(ctx.case)
            workers = vllm_sidecar_processes(ctx, env, roles)
            # The same race with vllm-rs workers: the frontend said "Chat completions is ready" when prefill's
            # worker set registered, and a request 40 ms later got 503 ("worker_unavailable") because decode's
            # set was committed 6 ms after that. Ready waits for both generate endpoints here too.
            wanted = tuple(".generate" for _ in roles)
            ready += (HealthProbe(loopback_url(frontend_port, "/health"), require_endpoints=wanted),)
            # The aggregated twin moves no KV, so it has no transfer counter to watch.
            metrics = () if _launch(ctx.case).aggregated else (decode_metrics(ctx),)
            lifecycle = vllm_lifecycle(ctx, roles)
            scratch += scratch_env(ctx).values()
        elif script is None and engine == "sglang":
            roles = _worker_roles(ctx.case)
            workers = sglang_sidecar_processes(ctx, env, roles)
            metrics = () if _launch(ctx.case).aggregated else (sglang_server.kv_metrics(ctx),)
            lifecycle = LifecycleSpec(str(ctx.work_dir))  # the streaming twin; SGLang's gauges are not wired yet
            scratch += sglang_server.scratch_env(ctx).values()
        else:
            workers = (self._script(ctx, engine, env, script),)
        return LaunchPlan(
            cell_id=ctx.cell_id,
            processes=(*workers, frontend),
            ready_probes=ready,
            request=chat_request(ctx, frontend_port),
            ports=dict(ports),
            startup_timeout_s=ctx.case.startup_timeout_s,
            teardown_grace_s=float(or_default(_launch(ctx.case).teardown_grace_s, 10.0)),
            gpu_ids=ctx.gpu_ids,
            metrics_checks=metrics,
            scratch_dirs=tuple(dict.fromkeys(scratch)),  # the sidecar arms name the cell's TMPDIR too
            lifecycle=lifecycle,
            topology=topology,
            peer_loss=peer_loss,
        )

    def _mocker(self, ctx: LaunchContext, name: str, env: dict[str, str]) -> ProcessSpec:
        """Mocker worker `name` ("decode_2"...: its process role and system port) in its role's mode."""
        system_port = ctx.ports[f"{name}_system"]
        argv: tuple[str, ...] = (
            ctx.python, "-m", "dynamo.mocker",
            "--model-path", str(ctx.model_dir or ctx.case.model),
            "--model-name", ctx.case.model,
            "--speedup-ratio", str(or_default(_launch(ctx.case).speedup_ratio, 10)),
        )  # fmt: skip
        if name != AGGREGATED_ROLE:
            argv += ("--disaggregation-mode", role_of(name))
        role_env = {
            **env,
            "DYN_SYSTEM_PORT": str(system_port),
            "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
        }
        health = (HealthProbe(loopback_url(system_port, "/health")),)
        return ProcessSpec(role=name, argv=argv, env=role_env, health=health)

    def _script(self, ctx: LaunchContext, engine: str, env: dict[str, str], script_text: str | None) -> ProcessSpec:
        if not script_text:
            raise ConfigError(
                f"case {ctx.case.name!r}: dynamo engine {engine!r} needs launch.script "
                f"(e.g. lib/sidecar/{engine}/launch/disagg.sh of a Dynamo checkout)"
            )
        base = ctx.workspace or Path(ctx.case.source_dir)
        script = (base / str(script_text)).resolve()
        if not script.is_file():
            raise ConfigError(
                f"case {ctx.case.name!r}: launch script {script_text} not found under {base}: pass "
                "`matrix run --workspace DIR` with a checkout that has it"
            )
        # The script sources its helpers relative to its own directory (SCRIPT_DIR), so it runs from there.
        script_env = {
            **env,
            **{name: str(ctx.ports[name]) for name in ENGINE_PORTS[engine]},
            "DYN_SYSTEM_PORT1": str(ctx.ports["prefill_system"]),
            "DYN_SYSTEM_PORT2": str(ctx.ports["decode_system"]),
            "DYN_HTTP_PORT": str(ctx.ports["frontend"]),
            "MODEL": ctx.case.model,
            **kv_bound_env(engine, ctx.case),
        }
        # Upstream's script pins each engine itself (CUDA_VISIBLE_DEVICES=$VLLM_<ROLE>_GPU, prefill on GPU 1
        # by default): both must name one of the cell's GPUs, or prefill lands on a GPU another cell owns; with
        # two, each role gets its device of upstream's layout (`ROLE_DEVICE`).
        two = len(ctx.gpu_ids) > 1
        devices = {role: ctx.gpu_ids[ROLE_DEVICE[role] if two else 0] for role in ("prefill", "decode") if ctx.gpu_ids}
        if engine == "vllm" and ctx.gpu_ids:
            script_env |= {"VLLM_PREFILL_GPU": devices["prefill"], "VLLM_DECODE_GPU": devices["decode"]}
        if engine == "trtllm" and ctx.gpu_ids:
            script_env |= {
                "TRTLLM_PREFILL_GPU": devices["prefill"],
                "TRTLLM_DECODE_GPU": devices["decode"],
                "PRTE_ALLOW_RUN_AS_ROOT": "1",
                "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            }
        health = tuple(
            HealthProbe(loopback_url(ctx.ports[f"{role}_system"], "/health")) for role in ("prefill", "decode")
        )
        argv = ("bash", str(script), *kv_bound_args(engine, ctx.case))
        return ProcessSpec(role="workers", argv=argv, env=script_env, cwd=str(script.parent), health=health)


# A mocker moves no KV (it models the transfer's time only), so a decode's ledger is the generate requests it
# served: each carries a prefill's disaggregated parameters, and the answer names that prefill
# (`nvext.worker_id`). The counters name no prefill peer: a decode's count covers all its pairs' choices.
MOCKER_DECODE_COUNTERS = (
    'dynamo_component_requests_total{dynamo_endpoint="generate"}',
    'dynamo_component_request_bytes_total{dynamo_endpoint="generate"}',
)
# The label of a worker's system /metrics whose value is its instance id in hex: what the frontend reports as
# `nvext.worker_id` (in decimal) and routes by.
MOCKER_ID_LABEL = "worker_id"
# Requests the topology check sends at once per worker, so the frontend's round robin reaches every one.
MOCKER_REQUESTS_PER_WORKER = 4


def _mocker_workers(ctx: LaunchContext) -> tuple[TopologyWorker, ...]:
    """Every mocker worker of the case's topology: its system server's /health and /metrics (the id's label)."""
    return tuple(
        TopologyWorker(
            name,
            role_of(name),
            loopback_url(ctx.ports[f"{name}_system"], "/health"),
            loopback_url(ctx.ports[f"{name}_system"], "/metrics"),
            id_label=MOCKER_ID_LABEL,
        )
        for name in worker_names(_launch(ctx.case).topology)
    )


def mocker_topology(ctx: LaunchContext) -> TopologySpec | None:
    """The xPyD check of a mocker case with `launch.topology` (`check.topology`), or None."""
    launch = _launch(ctx.case)
    if launch.topology is None:
        return None
    workers = _mocker_workers(ctx)
    return TopologySpec(
        launch.topology, workers, str(ctx.work_dir), decode_counters=MOCKER_DECODE_COUNTERS,
        requests=MOCKER_REQUESTS_PER_WORKER * len(workers),
    )  # fmt: skip


# What a mocker prefill worker publishes of its load (1.6.1): Dynamo's runtime gauges of the requests in its
# handlers and its work queue, and no KV gauge. A decode worker publishes vLLM's scheduler gauges.
MOCKER_PREFILL_GAUGES = ("dynamo_component_inflight_requests", "dynamo_work_handler_queue_depth", "")


def mocker_peer_loss(ctx: LaunchContext) -> PeerLossSpec | None:
    """The peer-loss check of a mocker case with `launch.peer_loss` over every worker of its topology: what a
    survivor still holds for the dead peer is read on its system /metrics (`MOCKER_PREFILL_GAUGES` for a
    prefill worker, vLLM's running, waiting and KV usage gauges for a decode worker)."""
    options = peer_loss_options(_launch(ctx.case).peer_loss)
    if options is None:
        return None
    workers = _mocker_workers(ctx)
    gauges = tuple(
        EngineGauges(w.name, w.metrics_url, *MOCKER_PREFILL_GAUGES) if w.role == "prefill"
        else EngineGauges(w.name, w.metrics_url)
        for w in workers
    )  # fmt: skip
    return PeerLossSpec(str(ctx.work_dir), workers, gauges, **options)
