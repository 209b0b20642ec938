"""One attempt of a cell: arm -> environments -> ports -> launch plan -> `serve_and_judge` -> outcome.

Everything a cell can go through ends in a `CellOutcome`; no exception from a cell escapes except an
interruption of the runner, and even then the supervisor tears the pair down first.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from matrix.cells import Cell
from matrix.check import faults
from matrix.errors import MatrixError
from matrix.hardware.ports import PortAllocator
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.caches import cache_env
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.providers import Environment, Unavailable, prepare, remove_cell_containers, wrap_plan
from matrix.launch.roles import compose_roles
from matrix.model_files import resolve_model_dir
from matrix.outcome import CellOutcome, error, failure, judge_control, judge_expectation, judge_fault, skipped
from matrix.runner.resources import LiveCells, Resources
from matrix.runner.serve import serve_and_judge, unready

# A skew cell is decided within this long after its pair is ready ([M20]: on a 2-core CPU host a vLLM pair
# answers in seconds): a request unanswered by then is a hang, cut with the evidence of who waited on what.
SKEW_BOUND_S = 120.0


def run_cell(
    cell: Cell,
    cell_id: str,
    log_dir: Path,
    allocator: PortAllocator,
    resources: Resources | None = None,
    live: LiveCells | None = None,
) -> CellOutcome:
    """Run one attempt to its outcome. Cancellation through `live` tears the pair down early."""
    started = time.monotonic()
    outcome = _run(cell, cell_id, log_dir, allocator, resources or Resources(), live or LiveCells())
    outcome = replace(outcome, total_s=time.monotonic() - started - outcome.queued_s, log_dir=str(log_dir))
    outcome = judge_control(outcome, cell.case.launch.expect_failed_checks or ())
    # [M28]: a cell with a KV fault is judged by whether it fired and was caught.
    if (fault := faults.evidence(cell.case.launch.kv_fault, log_dir)) is not None:
        outcome = judge_fault(outcome, *fault)
    return judge_expectation(outcome, cell.expected_failure if cell.missing_fixes else "")


def _run(
    cell: Cell, cell_id: str, log_dir: Path, allocator: PortAllocator, resources: Resources, live: LiveCells
) -> CellOutcome:
    case = cell.case
    try:
        arm = get_arm(case.arm)
        cpu_ok = arm.runs_on_cpu(case)
    except MatrixError as exc:
        return error("config", str(exc))
    gpus_needed = case.gpus_needed
    if gpus_needed > len(resources.gpu_ids) and not cpu_ok:
        return skipped(f"needs {gpus_needed} GPU, host has {resources.host_gpus}")
    environment = prepare(cell.runtime)
    if isinstance(environment, Unavailable):
        return unready(environment)
    # A skew cell's other runtimes, one environment each (`matrix.launch.roles`).
    role_envs: dict[str, Environment] = {}
    for role, runtime in cell.roles:
        if runtime.label != cell.runtime.label:
            role_env = prepare(runtime)
            if isinstance(role_env, Unavailable):
                why = unready(role_env)
                return replace(why, message=f"{role} runtime {runtime.label}: {why.message}")
            role_envs[role] = role_env
    # Persistent per-runtime engine caches (compiled kernels...); none for a container runtime. A variable
    # the runtime's provider sets itself is the catalog's choice and stays.
    caches = cache_env(cell.runtime) if environment.container is None else {}
    caches = {name: path for name, path in caches.items() if name not in environment.env}
    try:
        ports = allocator.allocate(cell_id, arm.port_requests(case))
    except MatrixError as exc:
        return error("infra", f"port allocation failed: {exc}")
    try:
        try:
            model_dir = resolve_model_dir(case.launch.model_dir, case.source_dir, environment.python)
        except MatrixError as exc:
            return failure("config", str(exc), ports=ports)
        context = LaunchContext(
            cell_id=cell_id,
            case=case,
            runtime=cell.runtime,
            ports=ports,
            work_dir=log_dir,
            python=environment.python,
            gpu_ids=resources.gpu_ids[:gpus_needed],
            env={**environment.env, **caches},
            caches=caches,
            model_dir=model_dir,
            workspace=resources.workspace,
        )
        try:
            plan = wrap_plan(
                environment, arm.plan(context), case=case, runtime=cell.runtime, workspace=log_dir, model_dir=model_dir
            )
            if role_envs:
                plan = compose_roles(plan, {role: _role_plan(arm, context, cell.runtime_of(role), env, log_dir)
                                            for role, env in role_envs.items()})  # fmt: skip
            if case.launch.lifecycle is False:  # a timing study: only the primary request
                plan = replace(plan, lifecycle=None)
            if cell.skewed:
                plan = bounded(plan, SKEW_BOUND_S)
        except MatrixError as exc:
            return error("config", str(exc), ports=ports)
        outcome = serve_and_judge(plan, arm, context, environment, allocator, resources, live)
        gpu = {"cuda_visible_devices": ",".join(context.gpu_ids)} if context.gpu_ids else {}
        return replace(outcome, ports={**ports, **outcome.ports}, components=dict(environment.components), gpu=gpu)
    finally:
        for env in (environment, *role_envs.values()):
            remove_cell_containers(env, cell_id)
        allocator.release(cell_id)


def bounded(plan: LaunchPlan, bound_s: float) -> LaunchPlan:
    """`plan` whose requests (the primary one, the lifecycle's, the oracle's) give up after `bound_s` at most."""
    request = replace(plan.request, timeout_s=min(plan.request.timeout_s, bound_s))
    oracle_spec = replace(plan.oracle, timeout_s=min(plan.oracle.timeout_s, bound_s)) if plan.oracle else None
    return replace(plan, request=request, oracle=oracle_spec)


def _role_plan(arm: Any, context: LaunchContext, runtime: Any, environment: Environment, log_dir: Path) -> LaunchPlan:
    """The cell planned in one role's runtime: same ports and directories, that runtime's interpreter,
    environment and caches (`compose_roles` takes that role's processes from it)."""
    caches = cache_env(runtime) if environment.container is None else {}
    caches = {name: path for name, path in caches.items() if name not in environment.env}
    role_context = replace(context, runtime=runtime, python=environment.python,
                           env={**environment.env, **caches}, caches=caches)  # fmt: skip
    return wrap_plan(environment, arm.plan(role_context), case=context.case, runtime=runtime, workspace=log_dir,
                     model_dir=context.model_dir)  # fmt: skip
