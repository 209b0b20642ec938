"""Run one cell: arm -> launch plan -> supervisor -> request -> validation -> teardown -> outcome.

Everything a cell can go through ends in a `CellOutcome`; no exception from a cell escapes except an
interruption of the runner, and even then the supervisor tears the pair down first.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from matrix.cells import Cell
from matrix.check import ledger, metrics, oracle
from matrix.check.baselines import PLACEHOLDER_CELL, PLACEHOLDER_DIR, Baseline, OracleBaselines, baseline_key
from matrix.check.client import send_chat
from matrix.check.lifecycle import run_lifecycle
from matrix.check.specs import CheckFailure, OracleSpec
from matrix.check.traffic import TrafficSession
from matrix.check.validate import validate_chat_response
from matrix.errors import MatrixError
from matrix.hardware.ports import PortAllocator
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import AggregatedArm, LaunchContext
from matrix.launch.caches import cache_env
from matrix.launch.hang import waiting_on
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.listeners import listening_sockets
from matrix.launch.providers import (
    Environment,
    Mismatch,
    ProvisionFailed,
    Unavailable,
    prepare,
    remove_cell_containers,
    wrap_plan,
)  # fmt: skip
from matrix.launch.roles import compose_roles
from matrix.launch.supervisor import Supervisor, TeardownReport, error_lines, find_cell_processes
from matrix.model_files import resolve_model_dir
from matrix.outcome import (
    PASSED,
    CellOutcome,
    FailureKind,
    after_teardown,
    as_error,
    checked,
    checked_again,
    error,
    failure,
    judge_control,
    judge_expectation,
    not_ready,
    passed,
    provision_failed,
    skipped,
    timed_out,
)
from matrix.skew_outcome import first_incompatibility, names_incompatibility
from matrix.telemetry import PeakSampler

# How much of the answer's text an outcome carries (the record keeps a 200-character excerpt of it).
COMPLETION_WINDOW = 16_384
# A skew cell is decided within this long after its pair is ready ([M20]: on a 2-core CPU host a vLLM pair
# answers in seconds): a request unanswered by then is a hang, cut with the evidence of who waited on what.
SKEW_BOUND_S = 120.0


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
    # The campaign's store of the oracle's aggregated answers (`matrix.check.baselines`); None: every pair
    # that passes starts its own aggregated instance.
    baselines: OracleBaselines | None = None


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
        """Start tearing down every running pair, each in a thread of its own (teardown is idempotent and
        thread-safe), and return: the driver stays free to say what it waits for and to take a second
        Ctrl-C, which `kill_all` answers."""
        with self._lock:
            self.cancelled = True
            supervisors = list(self._running.values())
            self.cancelled_at = time.monotonic()
        for supervisor in supervisors:
            threading.Thread(target=supervisor.teardown, name="matrix-cancel", daemon=True).start()

    def stopping(self) -> list[tuple[str, float]]:
        """(cell id, seconds of grace left at most) of each pair still being torn down after `cancel_all`."""
        with self._lock:
            running = list(self._running.items())
            since = time.monotonic() - getattr(self, "cancelled_at", time.monotonic())
        return [(cell_id, max(0.0, supervisor.teardown_budget_s - since)) for cell_id, supervisor in running]

    def kill_all(self) -> None:
        """SIGKILL every process of every running pair now (a second Ctrl-C); their teardowns then finish
        at once, still checking that nothing is left."""
        with self._lock:
            supervisors = list(self._running.values())
        for supervisor in supervisors:
            supervisor.kill_now()


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
    outcome = judge_control(outcome, cell.case.launch.expect_failed_checks or ())
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
        return _unready(environment)
    # A skew cell's other runtimes, one environment each (`matrix.launch.roles`).
    role_envs: dict[str, Environment] = {}
    for role, runtime in cell.roles:
        if runtime.label != cell.runtime.label:
            role_env = prepare(runtime)
            if isinstance(role_env, Unavailable):
                unready = _unready(role_env)
                return replace(unready, message=f"{role} runtime {runtime.label}: {unready.message}")
            role_envs[role] = role_env
    # Persistent per-runtime engine caches (compiled kernels...); none for a container runtime. A variable
    # the runtime's provider sets itself is the catalog's choice and stays.
    caches = cache_env(cell.runtime) if environment.container is None else {}
    caches = {name: path for name, path in caches.items() if name not in environment.env}
    try:
        ports = allocator.allocate(cell_id, arm.port_requests(case))
    except MatrixError as exc:
        return error("infra", f"port allocation failed: {exc}")
    traffic = TrafficSession(case.traffic, log_dir) if case.traffic is not None else None
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
                plan = _bounded(plan, SKEW_BOUND_S)
            if traffic is not None:  # the profile's prompts ride on the oracle: the twin answers them too
                plan = replace(plan, oracle=traffic.with_prompts(plan.oracle))
        except MatrixError as exc:
            return error("config", str(exc), ports=ports)
        for scratch in plan.scratch_dirs:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        supervisor = Supervisor(plan, log_dir)
        live.add(cell_id, supervisor)
        pd_answers: list[oracle.Completion | str] = []
        try:
            outcome = _supervise(
                supervisor, plan, resources, lambda p, ready_s: _request(p, ready_s, pd_answers, supervisor, traffic)
            )
        finally:
            live.remove(cell_id)
        if plan.oracle is not None and outcome.status == PASSED:
            outcome = _equivalence(
                outcome, plan.oracle, pd_answers, arm, context, environment, allocator, resources, live,
                resources.baselines, traffic,
            )
        gpu = {"cuda_visible_devices": ",".join(context.gpu_ids)} if context.gpu_ids else {}
        return replace(outcome, ports={**ports, **outcome.ports}, components=dict(environment.components), gpu=gpu)
    finally:
        for env in (environment, *role_envs.values()):
            remove_cell_containers(env, cell_id)
        allocator.release(cell_id)


def _bounded(plan: LaunchPlan, bound_s: float) -> LaunchPlan:
    """`plan` whose requests (the primary one, the lifecycle's, the oracle's) give up after `bound_s` at most."""
    request = replace(plan.request, timeout_s=min(plan.request.timeout_s, bound_s))
    oracle_spec = replace(plan.oracle, timeout_s=min(plan.oracle.timeout_s, bound_s)) if plan.oracle else None
    return replace(plan, request=request, oracle=oracle_spec)


def _unready(environment: Unavailable) -> CellOutcome:
    """The outcome of a runtime whose environment cannot run the cell."""
    if isinstance(environment, Mismatch):  # first: a Mismatch is a kind of Unavailable
        return failure("config", environment.reason)
    if isinstance(environment, ProvisionFailed):  # a recipe that does not build fails the release's cells
        return provision_failed(environment.reason)
    return skipped(environment.reason)


def _role_plan(arm: Any, context: LaunchContext, runtime: Any, environment: Environment, log_dir: Path) -> LaunchPlan:
    """The cell planned in one role's runtime: same ports and directories, that runtime's interpreter,
    environment and caches (`compose_roles` takes that role's processes from it)."""
    caches = cache_env(runtime) if environment.container is None else {}
    caches = {name: path for name, path in caches.items() if name not in environment.env}
    role_context = replace(context, runtime=runtime, python=environment.python,
                           env={**environment.env, **caches}, caches=caches)  # fmt: skip
    return wrap_plan(environment, arm.plan(role_context), case=context.case, runtime=runtime, workspace=log_dir,
                     model_dir=context.model_dir)  # fmt: skip


Query = Callable[[LaunchPlan, float], CellOutcome]


def _supervise(supervisor: Supervisor, plan: LaunchPlan, resources: Resources, query: Query) -> CellOutcome:
    sampler = PeakSampler(supervisor.pids, [int(g) for g in resources.gpu_ids if g.isdigit()], interval_s=0.05)
    queued: list[float] = [0.0]
    listeners: list[dict[str, Any]] = []
    try:
        outcome = _start_and_query(supervisor, sampler, plan, resources, queued, query)
    finally:
        if sampler.is_alive():
            sampler.sample()  # a last look at the steady state, before teardown frees everything
        # What the processes listen on, after the request (some engines open side channels on first use).
        listeners = listening_sockets(find_cell_processes(plan.cell_id), supervisor.pids())
        report = supervisor.teardown()
        peaks = sampler.stop() if sampler.is_alive() else {}
        for scratch in plan.scratch_dirs:
            shutil.rmtree(scratch, ignore_errors=True)
    exit_codes = {e.role: e.returncode for e in report.exits}
    outcome = replace(outcome, teardown_s=report.duration_s, exit_codes=exit_codes, peaks=peaks, queued_s=queued[0],
                      listeners=(*outcome.listeners, *listeners))  # fmt: skip
    return after_teardown(_with_refusal_evidence(outcome, supervisor.log_paths()), _teardown_checks(report))


# Checks whose failure means the pair refused the request rather than answered it wrongly.
_REFUSED_CHECKS = frozenset({"http_status", "request"})
_EVIDENCE_LINES = 3  # per role: the first error lines, and the first lines that name an incompatibility


def _with_refusal_evidence(outcome: CellOutcome, log_paths: dict[str, Path]) -> CellOutcome:
    """A request the pair refused (an HTTP error, a failed request) gets its processes' error lines in its message.

    The answer's body seldom says why: vLLM's decode answers 500 while its own log says "NIXL compatibility hash
    mismatch ... Prefill and decode instances have incompatible configurations", often after a traceback of a
    dozen lines. The lines naming an incompatibility are the evidence a reader (and the skew outcome class)
    needs, and the logs may be rotated away before anyone reads them.
    """
    if not any(check.name in _REFUSED_CHECKS for check in outcome.checks):
        return outcome
    found: list[str] = []
    for role, path in sorted(log_paths.items()):
        lines = error_lines(path).splitlines()
        naming = [line for line in lines if names_incompatibility(line)][:_EVIDENCE_LINES]
        said = first_incompatibility(path)  # a long traceback may push it past the error lines kept
        if said and not any(said in line for line in naming):
            naming.insert(0, said)
        first = [line for line in lines if line not in naming and not line.startswith("...")][:_EVIDENCE_LINES]
        if naming or first:
            found.append(f"--- error lines ({role}.log) ---\n" + "\n".join(naming + first))
    if not found:
        return outcome
    return replace(outcome, message="\n".join((outcome.message, *found)))


def _start_and_query(
    supervisor: Supervisor,
    sampler: PeakSampler,
    plan: LaunchPlan,
    resources: Resources,
    queued: list[float],
    query: Query,
) -> CellOutcome:
    waited = time.monotonic()
    try:
        with resources.startup_gate:
            queued[0] = time.monotonic() - waited
            supervisor.start()
            sampler.start()
            ready = supervisor.wait_ready()
    except MatrixError as exc:
        return failure("startup", str(exc))
    if not ready.ok:
        message = (
            ready.message
            + (f"\n--- error lines (whole log) ---\n{ready.error_lines}" if ready.error_lines else "")
            + (f"\n--- last log lines ---\n{ready.log_tail}" if ready.log_tail else "")
        )
        return not_ready(ready.kind, message)
    return query(plan, ready.ready_s)


def _request(
    plan: LaunchPlan,
    ready_s: float,
    oracle_answers: list[oracle.Completion | str],
    supervisor: Supervisor,
    traffic: TrafficSession | None = None,
) -> CellOutcome:
    scraped_before: dict[int, str] = {}
    before = metrics.baseline(plan.metrics_checks, scraped_before) if plan.metrics_checks else []
    response = send_chat(plan.request)
    if response.error_kind == "timeout":
        # A hang: read who waited on what while the pair is still up, before teardown takes the evidence.
        evidence = waiting_on(supervisor.pids(), supervisor.log_paths(), plan.request, response.request_s or 0.0)
        return timed_out(
            "request",
            f"no answer within {plan.request.timeout_s:g} s after ready ({response.error}); matrix cut the "
            f"pair\n--- who waited on what ---\n{evidence}",
            checks=(CheckFailure("request", response.error or "timed out"),),
            ready_s=ready_s,
            request_s=response.request_s,
        )
    if response.error is not None and response.error_kind != "oversized":
        return failure(
            "request",
            f"request failed ({response.error_kind}): {response.error}",
            checks=(CheckFailure("request", response.error),),
            ready_s=ready_s,
            request_s=response.request_s,
        )
    if response.error_kind == "oversized":
        return failure(
            "request",
            response.error or "response too large",
            checks=(CheckFailure("response_size", response.error or "response too large"),),
            ready_s=ready_s,
            request_s=response.request_s,
        )
    validation = validate_chat_response(response.status_code, response.body)
    failures = list(validation.failures)
    kv_ledger: dict[str, Any] = {}
    if plan.metrics_checks:
        scraped_after: dict[int, str] = {}
        window_s = metrics.settle_window(response.status_code)
        after = metrics.settle(plan.metrics_checks, before, window_s=window_s, texts=scraped_after)
        failures += metrics.judge(plan.metrics_checks, before, after)
        urls = [check.url for check in plan.metrics_checks]
        kv_ledger = ledger.ledger(urls, scraped_before, scraped_after)
    ttft_s = response.ttft_s
    if plan.lifecycle is not None:  # streaming, cancel and orphaned-decode checks; TTFT from the stream
        lifecycle_failures, ttft_s = run_lifecycle(plan.lifecycle, plan.request, tuple(failures))
        failures += lifecycle_failures
    if traffic is not None and not failures:  # [M27] the case's concurrent load; a hang is cut and fails here
        pids, logs, scraped = supervisor.pids, supervisor.log_paths, tuple(c.url for c in plan.metrics_checks)
        failures += traffic.run(plan.oracle, lambda asked, waited: waiting_on(pids(), logs(), asked, waited), scraped)
    common: dict[str, Any] = {
        "ready_s": ready_s,
        "request_s": response.request_s,
        "ttft_s": ttft_s,
        "prefill_worker_id": validation.prefill_worker_id,
        "decode_worker_id": validation.decode_worker_id,
        "prompt_tokens": validation.prompt_tokens,
        "completion_tokens": validation.completion_tokens,
        "finish_reason": validation.finish_reason,
        # The start of the answer, far longer than the excerpt the record keeps: the record redacts it and
        # only then cuts it, so a secret this cut halves is dropped by the second cut whatever it looks like.
        "completion_excerpt": (validation.content or "")[:COMPLETION_WINDOW],
        "kv_ledger": kv_ledger,
    }
    if not failures and plan.oracle is not None:  # the pair served correctly: now the prompts the oracle compares
        oracle_answers.extend(oracle.ask(plan.oracle, oracle.spec_prompts(plan.oracle)))
    return checked(failures, **common)


def _equivalence(
    pair: CellOutcome,
    spec: OracleSpec,
    pd_answers: list[oracle.Completion | str],
    arm: object,
    context: LaunchContext,
    environment: Environment,
    allocator: PortAllocator,
    resources: Resources,
    live: LiveCells,
    baselines: OracleBaselines | None = None,
    traffic: TrafficSession | None = None,
) -> CellOutcome:
    """The `equivalent_to_aggregated` check of a pair that passed: the arm's aggregated instance (same engine
    flags and seed, its own ports, supervised and torn down like the pair, after the pair is gone) answers
    the same prompts; per-prompt results go to `equivalence.json` in the log directory, the aggregated
    instance's time into the message and that file, its peaks under `peaks["aggregated"]`. With `baselines`
    (the campaign's), an earlier pair's answers from the very same instance plan are reused instead."""
    if not isinstance(arm, AggregatedArm):
        message = f"arm {context.case.arm} cannot launch an aggregated instance: remove launch.equivalence"
        return as_error(pair, "config", message)
    ran: list[CellOutcome] = []
    own: list[Baseline] = []

    def make() -> Baseline | None:
        outcome, answers, aggregated_s = _aggregated_answers(spec, arm, context, environment, allocator,
                                                             resources, live)  # fmt: skip
        ran.append(outcome)
        if outcome.status != PASSED:
            return None
        own.append(Baseline(tuple(answers), context.cell_id, aggregated_s, outcome.ready_s))
        return own[0] if own[0].complete else None

    if baselines is None:
        try:
            baseline, reused = make(), False
        except _NoInstance as exc:
            return as_error(pair, exc.kind, f"aggregated instance: {exc.message}")
    else:
        try:
            placeholder = _placeholder_plan(arm, context)
            key = baseline_key([(p.role, p.argv, p.env) for p in placeholder.processes], environment.python, spec)
            baseline, reused = baselines.get_or_make(key, make)
        except MatrixError as exc:
            return as_error(pair, "config", f"aggregated instance: {exc}")
        except _NoInstance as exc:
            return as_error(pair, exc.kind, f"aggregated instance: {exc.message}")
    if baseline is None and own:
        baseline, reused = own[0], False
    agg = ran[0] if ran else None
    merged = pair
    if agg is not None:
        merged = replace(
            pair,
            ports={**pair.ports, **agg.ports},
            exit_codes={**pair.exit_codes, **agg.exit_codes},
            peaks={**pair.peaks, "aggregated": dict(agg.peaks)} if agg.peaks else pair.peaks,
        )
    if baseline is None:
        assert agg is not None  # no baseline is only ever this pair's own failed instance
        message = f"aggregated instance (the equivalence baseline): {agg.message}"
        return replace(merged, status=agg.status, failure_kind=agg.failure_kind, message=message, checks=agg.checks)
    timing = f"aggregated instance {baseline.aggregated_s:.1f} s (ready {baseline.ready_s or 0:.1f} s)"
    if reused:
        timing = f"aggregated answers of {baseline.source_cell} reused (the same instance plan; {timing})"
    prompts = oracle.spec_prompts(spec)
    results = [
        oracle.compare(i, prompt, pd, ag, spec.near_tie_gap)
        for i, (prompt, pd, ag) in enumerate(zip(prompts, pd_answers, baseline.answers, strict=False))
    ]
    _write_equivalence(context.work_dir, spec, results, baseline, reused)
    failures = oracle.judge(results)
    if traffic is not None:  # [M27] every stream of the load against the twin's answer to its own prompt
        failures += traffic.judge(spec, baseline.answers)
        merged = replace(merged, peaks={**merged.peaks, "traffic": traffic.metrics})
        timing = f"{timing}; {traffic.summary()}"
    return checked_again(merged, failures, timing if failures else f"{oracle.summary(results)}; {timing}")


def _placeholder_plan(arm: AggregatedArm, context: LaunchContext) -> LaunchPlan:
    """The aggregated plan with placeholder ports, cell id and directory: what `baseline_key` compares."""
    requests = arm.aggregated_port_requests(context.case)
    ports = {request.name: index + 1 for index, request in enumerate(requests)}
    return arm.aggregated_plan(replace(context, ports=ports, cell_id=PLACEHOLDER_CELL, work_dir=PLACEHOLDER_DIR))


class _NoInstance(Exception):
    """The aggregated instance could not even be planned or given ports: the pair's row says why."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def _aggregated_answers(
    spec: OracleSpec,
    arm: AggregatedArm,
    context: LaunchContext,
    environment: Environment,
    allocator: PortAllocator,
    resources: Resources,
    live: LiveCells,
) -> tuple[CellOutcome, list[oracle.Completion | str], float]:
    """Start the aggregated instance, ask it the oracle's prompts, tear it down: (its outcome with the ports it
    had, the answers, its wall time). Raises `_NoInstance` when it cannot be planned or given ports."""
    owner = f"{context.cell_id}/aggregated"
    started = time.monotonic()
    answers: list[oracle.Completion | str] = []

    def ask(plan: LaunchPlan, ready_s: float) -> CellOutcome:
        # The same prompts and options as the pair's; only the endpoint is the aggregated instance's.
        target = replace(spec, url=plan.oracle.url) if plan.oracle is not None else None
        if target is None:
            return error("config", f"arm {context.case.arm}'s aggregated plan has no oracle endpoint")
        answers.extend(oracle.ask(target, oracle.spec_prompts(spec)))
        return passed(ready_s=ready_s)

    try:
        ports = allocator.allocate(owner, arm.aggregated_port_requests(context.case))
    except MatrixError as exc:
        raise _NoInstance("infra", str(exc)) from exc
    try:
        try:
            plan = wrap_plan(
                environment, arm.aggregated_plan(replace(context, ports=ports)), case=context.case,
                runtime=context.runtime, workspace=context.work_dir, model_dir=context.model_dir,
            )  # fmt: skip
        except MatrixError as exc:
            raise _NoInstance("config", str(exc)) from exc
        for scratch in plan.scratch_dirs:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        supervisor = Supervisor(plan, context.work_dir)
        live.add(context.cell_id, supervisor)
        try:
            agg = _supervise(supervisor, plan, resources, ask)
        finally:
            live.remove(context.cell_id)
    finally:
        allocator.release(owner)
    return replace(agg, ports={**agg.ports, **ports}), answers, time.monotonic() - started


def _write_equivalence(
    log_dir: Path, spec: OracleSpec, results: list[oracle.PromptResult], baseline: Baseline, reused: bool
) -> None:
    """equivalence.json: the options, the aggregated instance's time (and, when its answers were an earlier
    pair's, which pair's) and every prompt's comparison."""
    document = {
        "check": oracle.CHECK_NAME,
        "prompts": spec.prompts,
        "tokens": spec.tokens,
        "near_tie_gap": spec.near_tie_gap,
        "seed": spec.seed,
        "aggregated_s": round(baseline.aggregated_s, 3),
        "aggregated_ready_s": None if baseline.ready_s is None else round(baseline.ready_s, 3),
        "aggregated_reused_from": baseline.source_cell if reused else None,
        "summary": oracle.summary(results),
    }
    # One line per prompt: the token-id lists stay readable side by side.
    head = json.dumps(document, indent=1)[:-2]
    rows = ",\n  ".join(json.dumps(r.as_dict()) for r in results)
    text = f'{head},\n "results": [\n  {rows}\n ]\n}}\n'
    (log_dir / "equivalence.json").write_text(text, encoding="utf-8")
