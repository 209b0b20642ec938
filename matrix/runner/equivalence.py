"""The equivalence oracle's orchestration: after a pair passed and is torn down, the arm's aggregated instance
(same engine flags and seed, its own ports) answers the same prompts, and the per-prompt comparison judges the
pair's `equivalent_to_aggregated` check. The comparison itself is `matrix.check.oracle`'s."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from matrix.check import oracle
from matrix.check.baselines import PLACEHOLDER_CELL, PLACEHOLDER_DIR, Baseline, OracleBaselines, baseline_key
from matrix.check.specs import OracleSpec
from matrix.check.traffic import TrafficSession
from matrix.errors import MatrixError
from matrix.hardware.ports import PortAllocator
from matrix.launch.arms.base import AggregatedArm, LaunchContext
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.providers import Environment, wrap_plan
from matrix.launch.supervisor import Supervisor
from matrix.outcome import PASSED, CellOutcome, FailureKind, as_error, checked_again, error, passed
from matrix.runner.resources import LiveCells, Resources
from matrix.runner.supervise import supervise


def judge_equivalence(
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
    if traffic is not None:  # every stream of the load against the twin's answer to its own prompt
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
            agg = supervise(supervisor, plan, resources, ask)
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
