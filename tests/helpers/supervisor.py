"""Launch plans for the supervisor tests (fake engines on the test's ports)."""

from __future__ import annotations

import uuid

from matrix.launch.launch_plan import HealthProbe, LaunchPlan, ProcessSpec, RequestSpec


def models_probe(port: int) -> HealthProbe:
    return HealthProbe(f"http://127.0.0.1:{port}/v1/models", require_models=True)


def make_plan(
    processes: tuple[ProcessSpec, ...],
    ports: list[int],
    *,
    ready_probes: tuple[HealthProbe, ...] = (),
    startup_timeout_s: float = 10.0,
    teardown_grace_s: float = 2.0,
) -> LaunchPlan:
    return LaunchPlan(
        cell_id=f"test-{uuid.uuid4().hex[:12]}",
        processes=processes,
        ready_probes=ready_probes,
        request=RequestSpec(url=f"http://127.0.0.1:{ports[0]}/v1/chat/completions", model="m", prompt="hi"),
        ports={f"p{i}": port for i, port in enumerate(ports)},
        startup_timeout_s=startup_timeout_s,
        teardown_grace_s=teardown_grace_s,
    )
