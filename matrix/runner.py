"""Run one cell: arm -> launch plan -> supervisor -> request -> validation -> teardown -> outcome.

Everything a cell can go through ends in a `CellOutcome`; no exception from a cell escapes except an
interruption of the runner, and even then the supervisor tears the pair down first.
"""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from matrix.check import metrics
from matrix.check.client import send_chat
from matrix.check.validate import CheckFailure, validate_chat_response
from matrix.errors import MatrixError
from matrix.hardware.ports import PortAllocator
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.caches import cache_env
from matrix.launch.plan import LaunchPlan
from matrix.launch.providers import Mismatch, Unavailable, prepare, remove_cell_containers, wrap_plan
from matrix.launch.supervisor import Supervisor, TeardownReport
from matrix.models import resolve_model_dir
from matrix.outcome import CellOutcome, FailureKind, Status
from matrix.plan import Cell
from matrix.telemetry import PeakSampler


@dataclass(frozen=True)
class Resources:
    """What the scheduler granted one attempt."""

    # CUDA_VISIBLE_DEVICES entries (NVML indices) and the same GPUs as NVML indices for telemetry.
    gpu_ids: tuple[str, ...] = ()
    host_gpus: int = 0
    # A checkout that case launch scripts resolve against (`matrix run --workspace`).
    workspace: Path | None = None
    # Held while the pair starts, so start-ups on one GPU never overlap.
    startup_gate: AbstractContextManager[object] = field(default_factory=nullcontext)


class LiveCells:
    """The supervisors of running cells, so the driver can cancel them all from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Supervisor] = {}
        self.cancelled = False

    def add(self, cell_id: str, supervisor: Supervisor) -> None:
        with self._lock:
            self._running[cell_id] = supervisor
            cancelled = self.cancelled
        if cancelled:
            supervisor.teardown()

    def remove(self, cell_id: str) -> None:
        with self._lock:
            self._running.pop(cell_id, None)

    def cancel_all(self) -> None:
        """Tear down every running pair (teardown is idempotent and thread-safe)."""
        with self._lock:
            self.cancelled = True
            supervisors = list(self._running.values())
        for supervisor in supervisors:
            supervisor.teardown()


def _teardown_checks(report: TeardownReport) -> list[CheckFailure]:
    checks = []
    if report.needed_sigkill:
        checks.append(
            CheckFailure(
                "graceful_exit",
                f"{', '.join(report.needed_sigkill)} ignored SIGTERM for the grace period and had to be killed",
            )
        )
    if report.escaped_pids:
        checks.append(
            CheckFailure(
                "no_escaped_processes",
                f"{len(report.escaped_pids)} process(es) left their process group (pids "
                f"{', '.join(map(str, report.escaped_pids))}) and were found by MATRIX_CELL_ID and killed",
            )
        )
    if report.survivors:
        checks.append(CheckFailure("no_survivors", f"processes still alive after teardown: {report.survivors}"))
    if report.busy_ports:
        checks.append(CheckFailure("ports_released", f"ports still in use after teardown: {report.busy_ports}"))
    return checks


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
    return _judge_expectation(cell, _judge_control(cell, outcome))


def _judge_control(cell: Cell, outcome: CellOutcome) -> CellOutcome:
    """A control case proves the checks bite: it passes when exactly the checks it names fail.

    E.g. an aggregated deployment (one worker serving both phases) must fail `worker_ids_distinct`. The
    failed checks stay recorded; if they stop failing, the validator has gone blind and the cell fails.
    """
    expected = [str(name) for name in cell.case.launch.get("expect_failed_checks", [])]
    if not expected or outcome.status in ("skipped", "error"):
        return outcome
    failed = {check.name for check in outcome.checks}
    if outcome.failure_kind == "validation" and set(expected) == failed:
        note = f"control: {', '.join(expected)} failed as it must"
        return replace(outcome, status="passed", failure_kind=None, message=note)
    if outcome.status == "passed":
        message = f"control: expected {', '.join(expected)} to fail, but every check passed"
        check = CheckFailure("control_expectation", message + ": the validator no longer catches this deployment")
        return replace(outcome, status="failed", failure_kind="validation", message=message, checks=(check,))
    return outcome


def _judge_expectation(cell: Cell, outcome: CellOutcome) -> CellOutcome:
    """A runtime that lacks a required fix is expected to fail; a pass there means the catalog is wrong."""
    # A config failure (wrong or missing components) says nothing about the fix: never call it expected.
    if not cell.missing_fixes or outcome.status == "skipped" or outcome.failure_kind == "config":
        return outcome
    if outcome.status == "passed":
        note = f"unexpected pass: {cell.expected_failure}; correct the fix's fixed_in or the runtime's components"
        return replace(outcome, unexpected_pass=True, message=note)
    return replace(outcome, expected_failure=cell.expected_failure)


def _run(
    cell: Cell, cell_id: str, log_dir: Path, allocator: PortAllocator, resources: Resources, live: LiveCells
) -> CellOutcome:
    case = cell.case
    try:
        arm = get_arm(case.arm)
        cpu_ok = arm.runs_on_cpu(case)
    except MatrixError as exc:
        return CellOutcome("error", "config", str(exc))
    gpus_needed = case.gpus_needed
    if gpus_needed > len(resources.gpu_ids) and not cpu_ok:
        return CellOutcome("skipped", message=f"needs {gpus_needed} GPU, host has {resources.host_gpus}")
    environment = prepare(cell.runtime)
    if isinstance(environment, Mismatch):  # first: a Mismatch is a kind of Unavailable
        return CellOutcome("failed", "config", environment.reason)
    if isinstance(environment, Unavailable):
        return CellOutcome("skipped", message=environment.reason)
    # Persistent per-runtime engine caches (compiled kernels...); none for a container runtime. A variable
    # the runtime's provider sets itself is the catalog's choice and stays.
    caches = cache_env(cell.runtime) if environment.container is None else {}
    caches = {name: path for name, path in caches.items() if name not in environment.env}
    try:
        ports = allocator.allocate(cell_id, arm.port_requests(case))
    except MatrixError as exc:
        return CellOutcome("error", "infra", f"port allocation failed: {exc}")
    try:
        try:
            model_dir = resolve_model_dir(case.launch.get("model_dir"), case.source_dir, environment.python)
        except MatrixError as exc:
            return CellOutcome("failed", "config", str(exc), ports=ports)
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
            plan = wrap_plan(environment, arm.plan(context), case=case, runtime=cell.runtime, workspace=log_dir)
        except MatrixError as exc:
            return CellOutcome("error", "config", str(exc), ports=ports)
        for scratch in plan.scratch_dirs:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        supervisor = Supervisor(plan, log_dir)
        live.add(cell_id, supervisor)
        try:
            outcome = _supervise(supervisor, plan, resources)
        finally:
            live.remove(cell_id)
        gpu = {"cuda_visible_devices": ",".join(context.gpu_ids)} if context.gpu_ids else {}
        return replace(outcome, ports=ports, components=dict(environment.components), gpu=gpu)
    finally:
        remove_cell_containers(environment, cell_id)
        allocator.release(cell_id)


def _supervise(supervisor: Supervisor, plan: LaunchPlan, resources: Resources) -> CellOutcome:
    sampler = PeakSampler(supervisor.pids, [int(g) for g in resources.gpu_ids if g.isdigit()], interval_s=0.05)
    queued: list[float] = [0.0]
    try:
        outcome = _start_and_query(supervisor, sampler, plan, resources, queued)
    finally:
        if sampler.is_alive():
            sampler.sample()  # a last look at the steady state, before teardown frees everything
        report = supervisor.teardown()
        peaks = sampler.stop() if sampler.is_alive() else {}
        for scratch in plan.scratch_dirs:
            shutil.rmtree(scratch, ignore_errors=True)
    exit_codes = {e.role: e.returncode for e in report.exits}
    outcome = replace(outcome, teardown_s=report.duration_s, exit_codes=exit_codes, peaks=peaks, queued_s=queued[0])
    teardown_failures = _teardown_checks(report)
    if teardown_failures and outcome.status == "passed":
        names = ", ".join(c.name for c in teardown_failures)
        message = f"served correctly but teardown failed: {names}"
        checks = tuple(teardown_failures)
        return replace(outcome, status="failed", failure_kind="teardown", checks=checks, message=message)
    if teardown_failures:
        return replace(outcome, checks=(*outcome.checks, *teardown_failures))
    return outcome


def _start_and_query(
    supervisor: Supervisor, sampler: PeakSampler, plan: LaunchPlan, resources: Resources, queued: list[float]
) -> CellOutcome:
    waited = time.monotonic()
    try:
        with resources.startup_gate:
            queued[0] = time.monotonic() - waited
            supervisor.start()
            sampler.start()
            ready = supervisor.wait_ready()
    except MatrixError as exc:
        return CellOutcome("failed", "startup", str(exc))
    if not ready.ok:
        status: Status = "timeout" if ready.kind == "timeout" else "failed"
        kind: FailureKind = "startup" if ready.kind == "startup" else "health"
        message = (
            ready.message
            + (f"\n--- error lines (whole log) ---\n{ready.error_lines}" if ready.error_lines else "")
            + (f"\n--- last log lines ---\n{ready.log_tail}" if ready.log_tail else "")
        )
        # No ready time: the pair never got ready (a timeout would otherwise read as a 120 s start-up).
        return CellOutcome(status, kind, message)
    return _request(plan, ready.ready_s)


def _request(plan: LaunchPlan, ready_s: float) -> CellOutcome:
    before = metrics.baseline(plan.metrics_checks) if plan.metrics_checks else []
    response = send_chat(plan.request)
    if response.error is not None and response.error_kind != "oversized":
        return CellOutcome(
            "failed",
            "request",
            f"request failed ({response.error_kind}): {response.error}",
            checks=(CheckFailure("request", response.error),),
            ready_s=ready_s,
            request_s=response.request_s,
        )
    if response.error_kind == "oversized":
        return CellOutcome(
            "failed",
            "request",
            response.error or "response too large",
            checks=(CheckFailure("response_size", response.error or "response too large"),),
            ready_s=ready_s,
            request_s=response.request_s,
        )
    validation = validate_chat_response(response.status_code, response.body)
    failures = list(validation.failures)
    if plan.metrics_checks:
        failures += metrics.judge(plan.metrics_checks, before, metrics.settle(plan.metrics_checks, before))
    common: dict[str, Any] = {
        "ready_s": ready_s,
        "request_s": response.request_s,
        "ttft_s": response.ttft_s,
        "prefill_worker_id": validation.prefill_worker_id,
        "decode_worker_id": validation.decode_worker_id,
        "prompt_tokens": validation.prompt_tokens,
        "completion_tokens": validation.completion_tokens,
        "finish_reason": validation.finish_reason,
        "completion_excerpt": validation.content_excerpt or "",
    }
    if not failures:
        return CellOutcome("passed", **common)
    names = ", ".join(dict.fromkeys(f.name for f in failures))
    return CellOutcome("failed", "validation", f"failed checks: {names}", checks=tuple(failures), **common)
