"""Serve a pair and judge it: the one path both a per-cell attempt (`matrix.runner.attempt`) and a pair of a
shared-engine grid (`matrix.executors.grid_pair`) take once their plan is made.

`serve_and_judge` supervises the plan (start, ready, teardown: `matrix.runner.supervise`), sends the primary
request, runs the check steps on what it answered, and, when the pair passed and the plan has an oracle,
judges its equivalence with the aggregated instance (`matrix.runner.equivalence`).

The check steps after the primary request are `CHECK_STEPS`, in order; this is the place a new family of
checks goes (concurrent traffic, fault-injection evidence): one more `CheckStep`, whose `look` (optional)
runs before the primary request and whose `judge` runs after it, reading and adding to the `Exchange`
(failures, the outcome's fields). A step sees the failures of the steps before it; the oracle's prompts stay
last, since only a pair that passed everything before is asked them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from matrix.check import ledger, metrics, oracle, topology
from matrix.check.client import send_chat
from matrix.check.lifecycle import gauges_now, run_lifecycle
from matrix.check.peer_loss import judge_peer_loss
from matrix.check.specs import CheckFailure
from matrix.check.traffic import TrafficSession
from matrix.check.validate import validate_chat_response
from matrix.hardware.ports import PortAllocator
from matrix.launch.arms.base import LaunchContext
from matrix.launch.hang import waiting_on
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.providers import Environment, Mismatch, ProvisionFailed, Unavailable
from matrix.launch.supervisor import Supervisor
from matrix.outcome import PASSED, CellOutcome, checked, failure, provision_failed, skipped, timed_out
from matrix.runner.equivalence import judge_equivalence
from matrix.runner.resources import LiveCells, Resources
from matrix.runner.supervise import supervise

# How much of the answer's text an outcome carries (the record keeps a 200-character excerpt of it).
COMPLETION_WINDOW = 16_384


def serve_and_judge(
    plan: LaunchPlan,
    arm: object,
    context: LaunchContext,
    environment: Environment,
    allocator: PortAllocator,
    resources: Resources,
    live: LiveCells,
) -> CellOutcome:
    """Run `plan` (the pair of `context.cell_id`, logs in `context.work_dir`) to its judged outcome: the
    request and its check steps, the teardown's checks, then the equivalence oracle of a pair that passed."""
    traffic = TrafficSession(context.case.traffic, context.work_dir) if context.case.traffic is not None else None
    if traffic is not None:  # the profile's prompts ride on the oracle: the aggregated twin answers them too
        plan = replace(plan, oracle=traffic.with_prompts(plan.oracle))
    for scratch in plan.scratch_dirs:
        Path(scratch).mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(plan, context.work_dir)
    live.add(context.cell_id, supervisor)
    pd_answers: list[oracle.Completion | str] = []
    try:
        outcome = supervise(
            supervisor, plan, resources, lambda p, ready_s: request(p, ready_s, pd_answers, supervisor, traffic)
        )
    finally:
        live.remove(context.cell_id)
    if plan.oracle is not None and outcome.status == PASSED:
        outcome = judge_equivalence(
            outcome, plan.oracle, pd_answers, arm, context, environment, allocator, resources, live,
            resources.baselines, traffic,
        )  # fmt: skip
    return outcome


def unready(environment: Unavailable) -> CellOutcome:
    """The outcome of a runtime whose environment cannot run the cell."""
    if isinstance(environment, Mismatch):  # first: a Mismatch is a kind of Unavailable
        return failure("config", environment.reason)
    if isinstance(environment, ProvisionFailed):  # a recipe that does not build fails the release's cells
        return provision_failed(environment.reason)
    return skipped(environment.reason)


@dataclass
class Exchange:
    """The primary request to a ready pair and what the check steps found: what each step reads and adds to."""

    plan: LaunchPlan
    supervisor: Supervisor
    # The pair's answers to the oracle's prompts, which the equivalence judge compares after teardown.
    oracle_answers: list[oracle.Completion | str]
    # The case's concurrent load, when it has a traffic table (judged against the twin after teardown).
    traffic: TrafficSession | None = None
    # What each step's `look` saw before the request, by step name.
    looks: dict[str, Any] = field(default_factory=dict)
    status_code: int | None = None  # the primary request's HTTP status
    failures: list[CheckFailure] = field(default_factory=list)
    # The outcome's fields (`checked(failures, **fields)`): timings, workers, tokens, the KV ledger...
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckStep:
    """One family of checks around the primary request (see the module's docstring)."""

    name: str
    judge: Callable[[Exchange], None]  # after the request: add failures, set fields
    look: Callable[[Exchange], Any] | None = None  # before it: kept in `Exchange.looks[name]`


def _metrics_look(exchange: Exchange) -> Any:
    checks = exchange.plan.metrics_checks
    scraped: dict[int, str] = {}
    return (metrics.baseline(checks, scraped) if checks else []), scraped


def _metrics_judge(exchange: Exchange) -> None:
    """The KV-transfer metrics' deltas across the request, and the ledger of what moved."""
    checks = exchange.plan.metrics_checks
    if not checks:
        return
    before, scraped_before = exchange.looks["kv_metrics"]
    scraped_after: dict[int, str] = {}
    window_s = metrics.settle_window(exchange.status_code)
    after = metrics.settle(checks, before, window_s=window_s, texts=scraped_after)
    exchange.failures += metrics.judge(checks, before, after)
    exchange.fields["kv_ledger"] = ledger.ledger([check.url for check in checks], scraped_before, scraped_after)


def _lifecycle(exchange: Exchange) -> None:
    """Streaming, cancel and orphaned-decode checks; TTFT from the stream."""
    plan = exchange.plan
    if plan.lifecycle is None:
        return
    floor = exchange.looks.get("lifecycle")
    failures, ttft_s = run_lifecycle(plan.lifecycle, plan.request, tuple(exchange.failures), floor)
    exchange.failures += failures
    exchange.fields["ttft_s"] = ttft_s


def _lifecycle_look(exchange: Exchange) -> Any:
    """The engines' gauges before the primary request: the level `kv_released_after_answer` returns to."""
    spec = exchange.plan.lifecycle
    return gauges_now(spec.engines) if spec is not None and spec.engines else None


def _traffic(exchange: Exchange) -> None:
    """The case's concurrent load on a pair that served the single request right; a hang is cut and fails
    here with who waited on what, the streams' answers are judged against the twin after teardown."""
    traffic, plan, supervisor = exchange.traffic, exchange.plan, exchange.supervisor
    if traffic is None or exchange.failures:
        return
    scraped = tuple(check.url for check in plan.metrics_checks)
    if plan.topology is not None:  # every decode of an xPyD topology counts the transfers it pulled itself
        scraped = tuple(w.metrics_url for w in plan.topology.workers if w.role == "decode")
    pids, logs = supervisor.pids, supervisor.log_paths
    exchange.failures += traffic.run(
        plan.oracle,
        lambda asked, waited: waiting_on(pids(), logs(), asked, waited),
        scraped,
        disjoint=plan.topology is not None,
    )


def _topology_look(exchange: Exchange) -> topology.TopologyLook | None:
    spec = exchange.plan.topology
    return None if spec is None else topology.look(spec)


def _topology(exchange: Exchange) -> None:
    """An xPyD deployment ([M27]): every worker served under the load, KV moved on every pair it used."""
    spec, seen = exchange.plan.topology, exchange.looks.get("topology")
    if spec is None or seen is None or exchange.failures:
        return
    run = exchange.traffic.run_result if exchange.traffic is not None else None
    primary = {"prefill_worker_id": exchange.fields.get("prefill_worker_id"),
               "decode_worker_id": exchange.fields.get("decode_worker_id")}  # fmt: skip
    entries = [primary, *(w for a in (run.answered if run else []) for w in a.workers)]
    if run is None and spec.requests:  # no traffic load (no oracle for it): the check's own requests
        probed, refused = topology.probe(exchange.plan.request, spec.requests)
        entries += probed
        exchange.failures += refused
    failures, _record = topology.judge(spec, seen, topology.served_pairs(entries), run is not None or spec.requests > 0)
    exchange.failures += failures


def _peer_loss(exchange: Exchange) -> None:
    """[M27] peer loss: one worker per role killed under load and started again (`matrix.check.peer_loss`); last
    before the oracle's prompts, which the deployment it rejoined then answers."""
    spec, supervisor = exchange.plan.peer_loss, exchange.supervisor
    if spec is None or exchange.failures:
        return
    pids, logs = supervisor.pids, supervisor.log_paths
    exchange.failures += judge_peer_loss(
        spec, exchange.plan.request, supervisor, lambda asked, waited: waiting_on(pids(), logs(), asked, waited)
    )


def _oracle_prompts(exchange: Exchange) -> None:
    """The pair served correctly: now the prompts the oracle compares (judged after teardown)."""
    spec = exchange.plan.oracle
    if not exchange.failures and spec is not None:
        exchange.oracle_answers.extend(oracle.ask(spec, oracle.spec_prompts(spec)))


# In order; a new family of checks is one more step here (before `oracle_prompts`, which stays last).
CHECK_STEPS: tuple[CheckStep, ...] = (
    CheckStep("kv_metrics", _metrics_judge, look=_metrics_look),
    CheckStep("lifecycle", _lifecycle, look=_lifecycle_look),
    CheckStep("traffic", _traffic),
    CheckStep("topology", _topology, look=_topology_look),
    CheckStep("peer_loss", _peer_loss),
    CheckStep("oracle_prompts", _oracle_prompts),
)


def request(
    plan: LaunchPlan,
    ready_s: float,
    oracle_answers: list[oracle.Completion | str],
    supervisor: Supervisor,
    traffic: TrafficSession | None = None,
) -> CellOutcome:
    """Send the primary request to the ready pair and run `CHECK_STEPS` on its answer: the outcome before
    teardown. A hang, a failed request or an oversized answer ends it before any check step judges."""
    exchange = Exchange(plan, supervisor, oracle_answers, traffic)
    for step in CHECK_STEPS:
        if step.look is not None:
            exchange.looks[step.name] = step.look(exchange)
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
    exchange.status_code = response.status_code
    exchange.failures = list(validation.failures)
    exchange.fields = {
        "ready_s": ready_s,
        "request_s": response.request_s,
        "ttft_s": response.ttft_s,
        "prefill_worker_id": validation.prefill_worker_id,
        "decode_worker_id": validation.decode_worker_id,
        "prompt_tokens": validation.prompt_tokens,
        "completion_tokens": validation.completion_tokens,
        "finish_reason": validation.finish_reason,
        # The start of the answer, far longer than the excerpt the record keeps: the record redacts it and
        # only then cuts it, so a secret this cut halves is dropped by the second cut whatever it looks like.
        "completion_excerpt": (validation.content or "")[:COMPLETION_WINDOW],
        "kv_ledger": {},
    }
    for step in CHECK_STEPS:
        step.judge(exchange)
    return checked(exchange.failures, **exchange.fields)
