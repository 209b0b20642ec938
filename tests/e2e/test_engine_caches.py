"""[M17] goal 4: each runtime's engines keep their caches in a persistent directory of its own.

The plans real arms build are inspected for the variables their processes get (vLLM, SGLang, Dynamo), and
real reference pairs prove the round trip: the first cell of a runtime builds its "kernels" into the
cache directory, the second finds them, and another runtime version never sees them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.cells import CaseInfo, Cell, RuntimeInfo
from matrix.doctor import host_facts, host_lines
from matrix.hardware.ports import PortAllocator
from matrix.kv_bound import KvBound
from matrix.launch import caches
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.markers import parse_marker_use
from matrix.paths import port_registry_path
from matrix.runner import run_cell


def _runtime(backend: str, version: str, **provider: object) -> RuntimeInfo:
    return RuntimeInfo(backend=backend, version=version, tag=f"v{version}", provider=provider or {"kind": "host"})


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MATRIX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(caches.SWITCH_ENV, raising=False)
    return tmp_path / "home"


def _plan_env(
    arm: str, launch: dict[str, object], runtime: RuntimeInfo, work: Path
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Every process's environment merged, and the scratch dirs, of the plan the arm builds for a GPU cell."""
    case = CaseInfo(
        name="c", backend=runtime.backend, arm=arm, model="m", markers=(parse_marker_use("gpu_1"),),
        kv_bound=KvBound(bytes=1 << 30, tokens=2048), launch=launch,
    )  # fmt: skip
    ports = {request.name: 20000 + i for i, request in enumerate(get_arm(arm).port_requests(case))}
    env = caches.cache_env(runtime)
    ctx = LaunchContext(cell_id="x", case=case, runtime=runtime, ports=ports, work_dir=work, gpu_ids=("0",),
                        env=env, caches=env)  # fmt: skip
    plan = get_arm(arm).plan(ctx)
    merged: dict[str, str] = {}
    for spec in plan.processes:
        if spec.argv[:3][-1] in ("dynamo.frontend",) or "pdproxy" in " ".join(spec.argv):
            continue  # the frontends and proxies compile nothing
        merged |= {k: v for k, v in spec.env.items() if k in caches.CACHE_VARIABLES}
        for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            if name in env:  # every engine process of the pair, not just one
                assert spec.env.get(name) == env[name], (spec.role, name)
    return merged, plan.scratch_dirs


@pytest.mark.parametrize(
    ("arm", "launch"),
    [("vllm_native", {}), ("sglang_native", {}), ("dynamo", {"engine": "vllm"}), ("dynamo", {"engine": "sglang"})],
)
def test_a_real_arm_points_its_engines_at_the_runtime_caches(
    home: Path, tmp_path: Path, arm: str, launch: dict[str, object]
) -> None:
    runtime = _runtime("vllm", "0.30.0")
    env, scratch = _plan_env(arm, launch, runtime, tmp_path / "cell")
    root = caches.caches_root() / caches.runtime_key(runtime)
    assert root.parent == home / "caches"
    assert env["VLLM_CACHE_ROOT"] == str(root / "vllm") and env["TRITON_CACHE_DIR"] == str(root / "triton")
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(root / "flashinfer")
    # Dynamo keeps its frontend's model-card cache (under XDG_CACHE_HOME) inside the cell, on purpose.
    persistent = {k: v for k, v in env.items() if not (arm == "dynamo" and k == "XDG_CACHE_HOME")}
    assert all(Path(path).is_dir() and Path(path).is_relative_to(root) for path in persistent.values())
    # What persists is never a scratch directory the runner removes after the cell.
    assert not any(Path(s).is_relative_to(home) for s in scratch), scratch


def test_two_runtimes_never_share_and_one_runtime_always_does(home: Path) -> None:
    a, b = _runtime("vllm", "0.30.0"), _runtime("vllm", "0.31.0")
    rebuilt = _runtime("vllm", "0.30.0", kind="venv", steps=[["vllm==0.30.0"]])  # same version, other recipe
    keys = {caches.runtime_key(r) for r in (a, b, rebuilt)}
    assert len(keys) == 3
    assert caches.runtime_key(a) == caches.runtime_key(_runtime("vllm", "0.30.0"))
    assert caches.runtime_key(a).startswith("vllm-0.30.0-")
    assert set(caches.cache_env(a).values()).isdisjoint(caches.cache_env(b).values())


def test_caches_can_be_switched_off_and_containers_get_none(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert caches.cache_env(_runtime("sglang", "0.5.21", kind="container", image="x/y:z")) == {}
    monkeypatch.setenv(caches.SWITCH_ENV, "off")
    runtime = _runtime("vllm", "0.30.0")
    assert caches.cache_env(runtime) == {}
    env, scratch = _plan_env("vllm_native", {}, runtime, tmp_path / "cell")
    assert not any(Path(v).is_relative_to(home) for v in env.values())  # nothing persistent reaches the engines...
    assert str(tmp_path / "cell" / "vllm-cache") in scratch  # ...they keep a cache inside the cell, as before


def _reference_cell(version: str) -> Cell:
    case = CaseInfo(name="ref", backend="reference", arm="reference", model="reference-model", markers=(),
                    kv_bound=KvBound(bytes=1 << 20), startup_timeout_s=60.0)  # fmt: skip
    runtime = RuntimeInfo(backend="reference", version=version, tag=f"v{version}", provider={"kind": "builtin"})
    return Cell(case=case, runtime=runtime)


def test_the_second_cell_of_a_runtime_finds_the_first_ones_cache(home: Path, tmp_path: Path) -> None:
    allocator = PortAllocator(port_registry_path())
    logs = []
    for index, version in enumerate(["0.1.0", "0.1.0", "0.2.0"]):
        outcome = run_cell(_reference_cell(version), f"cache{index}", tmp_path / f"cell{index}", allocator)
        assert outcome.status == "passed", outcome.message
        logs.append((tmp_path / f"cell{index}" / "prefill.log").read_text())
    first, second, other = logs
    assert "kernel cache miss" in first and "kernel cache hit" not in first
    assert "kernel cache hit" in second and "kernel cache miss" not in second
    assert "kernel cache miss" in other  # another version starts cold: nothing leaks between runtimes
    cached = {c.key.split("-")[1]: c for c in caches.list_caches()}
    assert set(cached) == {"0.1.0", "0.2.0"} and all(c.files > 0 for c in cached.values())
    # doctor shows them; clearing one runtime leaves the other.
    assert "2 runtime(s)" in dict(host_lines(host_facts()))["engine caches"]
    removed = caches.clear_caches([cached["0.1.0"].key])
    assert [c.key for c in removed] == [cached["0.1.0"].key]
    assert [c.key for c in caches.list_caches()] == [cached["0.2.0"].key]


def test_a_cache_variable_the_runtime_sets_itself_wins(home: Path, tmp_path: Path) -> None:
    own = tmp_path / "own-cache"
    cell = _reference_cell("0.1.0")
    runtime = RuntimeInfo(backend="reference", version="0.1.0", tag="v0.1.0",
                          provider={"kind": "builtin", "env": {"XDG_CACHE_HOME": str(own)}})  # fmt: skip
    outcome = run_cell(
        Cell(case=cell.case, runtime=runtime), "own", tmp_path / "cell", PortAllocator(tmp_path / "p.json")
    )
    assert outcome.status == "passed", outcome.message
    assert f"kernel cache miss: built {own}" in (tmp_path / "cell" / "prefill.log").read_text()
