"""The arm protocol: how one kind of deployment turns a cell into a `LaunchPlan`."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from matrix.case_launch import or_default
from matrix.cells import CaseInfo, RuntimeInfo
from matrix.check.specs import OracleSpec
from matrix.hardware.gpus import CHILD_ENV
from matrix.hardware.ports import PortRequest
from matrix.launch.launch_plan import HealthProbe, LaunchPlan, ProcessSpec, RequestSpec
from matrix.launch.options import check_equivalence

DEFAULT_PROMPT = (
    "Disaggregated serving splits inference into two phases. The prefill worker reads this whole prompt, "
    "builds the key-value cache for every token and hands that cache to the decode worker, which then "
    "generates the answer one token at a time. Explain, in a few sentences, why separating these two "
    "phases lets an operator size each pool of workers for its own bottleneck: prefill is bound by "
    "compute over long prompts, while decode is bound by memory bandwidth over many short steps."
)


@dataclass(frozen=True)
class LaunchContext:
    """What an arm needs to plan one attempt of one cell."""

    cell_id: str
    case: CaseInfo
    runtime: RuntimeInfo
    ports: Mapping[str, int]
    work_dir: Path
    python: str = sys.executable
    gpu_ids: tuple[str, ...] = ()
    # Extra environment from the runtime's provider (PATH, PYTHONPATH...).
    env: Mapping[str, str] = field(default_factory=dict)
    # A local model directory (generated or given by the case); None means the model name as is.
    model_dir: Path | None = None
    # matrix's own interpreter, for helper processes that are matrix code (e.g. the P/D proxy).
    matrix_python: str = sys.executable
    # A checkout (e.g. of Dynamo) that case launch scripts resolve against, from `matrix run --workspace`.
    workspace: Path | None = None
    # A short per-cell temporary directory: engines put Unix sockets there, whose paths must stay under
    # 108 bytes, so it cannot live inside the (deep) log directory. Created and removed by the runner.
    tmp_dir: Path | None = None
    # The runtime's persistent engine caches (`matrix.launch.caches`), also part of `env`: an arm keeps a cache
    # inside the cell only when the runtime has none for that variable (`cell_scratch`).
    caches: Mapping[str, str] = field(default_factory=dict)
    # The CPUs this runner may use, for arms that split them between the processes of a pair.
    cpu_ids: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))


class Arm(Protocol):
    name: str

    def port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]:
        """Every port the plan will need, with its upper bound."""
        ...

    def runs_on_cpu(self, case: CaseInfo) -> bool:
        """Whether this case can run on a host without GPUs."""
        ...

    def absolute_memory(self, case: CaseInfo) -> bool:
        """Whether every instance's GPU memory is bounded absolutely (KV bytes or tokens with a tiny
        utilisation fraction), not sized from what is free: then its start-up may overlap others."""
        ...

    def plan(self, ctx: LaunchContext) -> LaunchPlan:
        """Pure: build the plan, start nothing."""
        ...


@runtime_checkable
class AggregatedArm(Arm, Protocol):
    """An arm that can also launch its deployment aggregated (one instance, same engine flags and seed), the
    baseline of the `equivalent_to_aggregated` check."""

    def aggregated_port_requests(self, case: CaseInfo) -> tuple[PortRequest, ...]: ...

    def aggregated_plan(self, ctx: LaunchContext) -> LaunchPlan:
        """Pure, like `plan`; `ctx.ports` holds the aggregated ports."""
        ...


def equivalence_options(case: CaseInfo) -> dict[str, int | float] | None:
    """The case's `launch.equivalence` (true, or a table of `EQUIVALENCE_DEFAULTS` keys), checked; None when
    the case does not opt in. Raises ConfigError naming the bad key and the fix."""
    return check_equivalence(case.name, case.launch.equivalence)


def oracle_spec(ctx: LaunchContext, port: int) -> OracleSpec | None:
    """The oracle's request spec for the deployment whose OpenAI frontend listens on `port`."""
    options = equivalence_options(ctx.case)
    if options is None:
        return None
    return OracleSpec(
        url=loopback_url(port, "/v1/completions"),
        model=str(ctx.case.payload.get("model", ctx.case.model)),
        prompts=int(options["prompts"]),
        tokens=int(options["tokens"]),
        near_tie_gap=float(options["near_tie_gap"]),
        seed=int(options["seed"]),
        timeout_s=ctx.case.request_timeout_s,
    )


def cell_scratch(ctx: LaunchContext, scratch: Mapping[str, str]) -> dict[str, str]:
    """The cell-local directories of `scratch` (variable -> path) except those the runtime's persistent
    caches provide: those stay in `ctx.env`, and are never removed with the cell."""
    return {name: path for name, path in scratch.items() if name not in ctx.caches}


def cell_tmp_dir(ctx: LaunchContext) -> Path:
    return ctx.tmp_dir or Path(tempfile.gettempdir()) / f"matrix-{ctx.cell_id}"


# Knobs that keep an engine's side channels on loopback, for every arm whose processes may read them (an
# engine ignores variables it does not know). UCX (NIXL's transport) picks its network devices from
# UCX_NET_DEVICES: "lo" leaves the host's NICs out (same-host GPU transports such as cuda_ipc are not
# network devices and stay available); vLLM advertises VLLM_HOST_IP instead of the address it detects.
# What still binds elsewhere is recorded per cell (`matrix.launch.listeners`) and listed in docs/security.md.
LOOPBACK_ENV: Mapping[str, str] = {"UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1"}


def loopback_url(port: int, path: str = "") -> str:
    return f"http://127.0.0.1:{port}{path}"


def frontend_probes(port: int) -> tuple[HealthProbe, ...]:
    """A pair is ready when its OpenAI frontend lists a model and says it is healthy."""
    return (
        HealthProbe(loopback_url(port, "/v1/models"), require_models=True),
        HealthProbe(loopback_url(port, "/health")),
    )


def chat_request(ctx: LaunchContext, frontend_port: int) -> RequestSpec:
    payload = ctx.case.payload
    return RequestSpec(
        url=loopback_url(frontend_port, "/v1/chat/completions"),
        model=str(payload.get("model", ctx.case.model)),
        prompt=str(payload.get("prompt", DEFAULT_PROMPT)),
        max_tokens=int(payload.get("max_tokens", 64)),
        timeout_s=ctx.case.request_timeout_s,
    )


def served_plan(
    ctx: LaunchContext, port: int, processes: tuple[ProcessSpec, ...], *, grace_s: float, **extra: Any
) -> LaunchPlan:
    """A plan whose OpenAI endpoint is on `port` (a frontend, a proxy or one aggregated engine): ready when it
    answers, the chat request sent there, `launch.teardown_grace_s` (else the arm's `grace_s`) to stop in.
    `extra`: the plan's other fields (metrics checks, scratch directories, the oracle)."""
    return LaunchPlan(
        cell_id=ctx.cell_id,
        processes=processes,
        ready_probes=frontend_probes(port),
        request=chat_request(ctx, port),
        ports=dict(ctx.ports),
        startup_timeout_s=ctx.case.startup_timeout_s,
        # Every arm's table has the key but the common one (`case_launch`): a table without it takes `grace_s`.
        teardown_grace_s=float(or_default(getattr(ctx.case.launch, "teardown_grace_s", None), grace_s)),
        gpu_ids=ctx.gpu_ids,
        **extra,
    )


def pd_proxy(ctx: LaunchContext, prefill_port: int, decode_port: int, *protocol_args: str) -> ProcessSpec:
    """matrix's P/D proxy on the cell's `proxy` port in front of two engines (`python -m matrix.pdproxy`).

    The proxy is matrix's own code: it runs with matrix's interpreter, not the runtime's."""
    port = ctx.ports["proxy"]
    argv = (
        ctx.matrix_python, "-m", "matrix.pdproxy",
        "--port", str(port),
        "--prefill-url", loopback_url(prefill_port),
        "--decode-url", loopback_url(decode_port),
        "--timeout-s", str(ctx.case.request_timeout_s),
        *protocol_args,
    )  # fmt: skip
    return ProcessSpec(
        role="proxy", argv=argv, env={"PYTHONUNBUFFERED": "1"}, health=(HealthProbe(loopback_url(port, "/live")),)
    )


def gpu_env(ctx: LaunchContext) -> dict[str, str]:
    """Pin every process of the pair to the cell's GPUs (NVML indices, so PCI bus order); hide all GPUs
    from CPU cells so they cannot land on a GPU another cell owns."""
    return {**CHILD_ENV, "CUDA_VISIBLE_DEVICES": ",".join(ctx.gpu_ids)}


# Upstream's layout of a pair on two GPUs ([M32]; Dynamo's disagg.sh: prefill on GPU 1, decode on GPU 0): the
# index, among the cell's GPUs, of the device each role's engines run on. The oracle's aggregated instance
# serves as decode does.
ROLE_DEVICE = {"prefill": 1, "decode": 0, "aggregated": 0, "worker": 0}


# An engine that spreads itself over several GPUs needs every one of the cell's: no role split then.
_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp")


def _parallel(ctx: LaunchContext) -> bool:
    args = [str(a).partition("=")[0] for a in getattr(ctx.case.launch, "extra_args", None) or ()]
    return any(flag in args for flag in _PARALLEL_FLAGS)


def role_gpu_env(ctx: LaunchContext, role: str) -> dict[str, str]:
    """`gpu_env` for one engine of `role`: on a cell with two GPUs or more (a `gpu_2` case), the role's own
    device only, so prefill and decode run on different GPUs and NIXL moves the KV between them (with both
    devices visible, every engine would take the first); on one GPU or none, or for an engine the case spreads
    over several (tensor, pipeline or data parallel `args`), the cell's as `gpu_env`."""
    if len(ctx.gpu_ids) < 2 or _parallel(ctx):
        return gpu_env(ctx)
    # A topology's later workers ("prefill_2") run where their role does.
    return {**CHILD_ENV, "CUDA_VISIBLE_DEVICES": ctx.gpu_ids[ROLE_DEVICE.get(role.partition("_")[0], 0)]}
