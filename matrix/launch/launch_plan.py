"""Pure-data description of what a cell launches.

An arm turns a cell plus allocated resources into a `LaunchPlan`; the supervisor starts it. Nothing here
starts a process, so plans are built and inspected in unit tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The request and the metrics checks are the check stage's own input; a plan carries them (re-exported here
# for the arms that build plans).
from matrix.check.specs import (
    EngineGauges,
    LifecycleSpec,
    MetricsCheck,
    OracleSpec,
    PeerLossSpec,
    RequestSpec,
    TopologySpec,
)

__all__ = [
    "EngineGauges",
    "HealthProbe",
    "LaunchPlan",
    "LifecycleSpec",
    "MetricsCheck",
    "OracleSpec",
    "PeerLossSpec",
    "ProcessSpec",
    "RequestSpec",
    "TopologySpec",
]


@dataclass(frozen=True)
class HealthProbe:
    """An HTTP GET that must answer 200; with `require_models`, the body must list at least one model; with
    `require_endpoints`, its JSON `endpoints` must include a distinct one ending in each of them (Dynamo's
    frontend `/health` lists the worker endpoints it has discovered)."""

    url: str
    require_models: bool = False
    require_endpoints: tuple[str, ...] = ()


@dataclass(frozen=True)
class LogSettle:
    """Once a process has logged a line matching `opened`, readiness also waits until it logs one matching
    `settled`, for at most `wait_s` (then it goes on: a release that words it otherwise must not time out).
    For a server that answers its probes while it is still finishing what it announced: Dynamo 1.6.1's
    frontend listed a prefill worker's endpoint on /health 65 ms before it logged "Prefill router target
    activated", and a request in between got 503 "Service temporarily unavailable" (CI, 2026-12-05)."""

    opened: str  # regular expressions, searched in each line of the process's output
    settled: str
    wait_s: float = 5.0


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a pair: its role name, argv (never a shell string), extra environment and probes."""

    role: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    health: tuple[HealthProbe, ...] = ()
    # Lines that make readiness wait for a later line (see `LogSettle`); checked once every probe passed.
    settles: tuple[LogSettle, ...] = ()
    # Roles (earlier in the plan) whose probes must pass before this process is started: a sidecar that
    # connects to its engine's gRPC port once, at start, must not start before the engine listens.
    start_after: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start, probe, query and tear down one cell."""

    cell_id: str
    processes: tuple[ProcessSpec, ...]
    # Probed after every process's own probes pass (e.g. the frontend's model list).
    ready_probes: tuple[HealthProbe, ...]
    request: RequestSpec
    ports: Mapping[str, int]
    startup_timeout_s: float = 120.0
    teardown_grace_s: float = 5.0
    gpu_ids: tuple[str, ...] = ()
    metrics_checks: tuple[MetricsCheck, ...] = ()
    # Per-cell scratch directories (discovery stores, caches) removed after teardown; logs are kept.
    scratch_dirs: tuple[str, ...] = ()
    # The equivalence oracle's prompts for this deployment (cases with `launch.equivalence`): the pair's
    # plan and the arm's aggregated plan each carry one, pointing at their own completions endpoint.
    oracle: OracleSpec | None = None
    # Set when the processes run in containers: the engine the watchdog removes the cell's containers with.
    container_engine: str = ""
    # Streaming, cancellation and orphaned-decode checks after the primary request (`matrix.check.lifecycle`).
    lifecycle: LifecycleSpec | None = None
    # Several workers per role behind one frontend ([M27] xPyD): each must serve, KV must move on each pair used.
    topology: TopologySpec | None = None
    # One worker per role killed (-9) under load, then started again ([M27] peer loss, `matrix.check.peer_loss`).
    peer_loss: PeerLossSpec | None = None
