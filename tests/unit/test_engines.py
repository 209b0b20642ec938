"""The engine table: each engine's KV flag, memory fraction and defaults in one entry, read by every arm."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.arm_table import ARM_ROWS
from matrix.cells import CaseInfo, RuntimeInfo
from matrix.engines import ENGINES, tiny_fraction
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.options import LAUNCH_KEYS
from matrix.markers import parse_marker_use

# (arm, launch, the engine entry its argv and absolute_memory come from, the engine's roles in the plan)
ARMS = [
    ("vllm_native", {}, "vllm", ("prefill", "decode")),
    ("dynamo", {"engine": "vllm"}, "dynamo-vllm", ("prefill", "decode")),
    ("sglang_native", {}, "sglang", ("prefill", "decode")),
    ("dynamo", {"engine": "sglang"}, "sglang", ("prefill", "decode")),
]


def _case(arm: str, launch: dict[str, object], bound: KvBound) -> CaseInfo:
    return CaseInfo(
        name="c", backend="x", arm=arm, model="m", markers=(parse_marker_use("gpu_1"),), launch=launch, kv_bound=bound
    )


def _argv(case: CaseInfo, tmp_path: Path, role: str) -> tuple[str, ...]:
    arm = get_arm(case.arm)
    ports = {req.name: 22000 + i for i, req in enumerate(arm.port_requests(case))}
    ctx = LaunchContext("cell1", case, RuntimeInfo("x", "1.0", "v1.0"), ports, tmp_path, python="/py",
                        gpu_ids=("0",), model_dir=tmp_path)  # fmt: skip
    return next(p.argv for p in arm.plan(ctx).processes if p.role == role)


def _flag(argv: tuple[str, ...], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(("arm", "launch", "name", "roles"), ARMS)
def test_argv_and_absolute_memory_come_from_the_entry(
    arm: str, launch: dict[str, object], name: str, roles: tuple[str, ...], tmp_path: Path
) -> None:
    engine = ENGINES[name]
    assert engine.fraction is not None and engine.default_kv is not None
    bounded = KvBound.parse({engine.unit: 4096})
    for role in roles:
        argv = _argv(_case(arm, launch, bounded), tmp_path, role)
        assert _flag(argv, engine.kv_flag) == "4096"
        assert _flag(argv, engine.fraction.flag) == str(engine.fraction.default)
        unbounded = _argv(_case(arm, launch, KvBound()), tmp_path, role)
        assert _flag(unbounded, engine.kv_flag) == str(engine.default_kv)
        overridden = _argv(_case(arm, {**launch, engine.fraction.launch_key: 0.07}, bounded), tmp_path, role)
        assert _flag(overridden, engine.fraction.flag) == "0.07"
    absolute = get_arm(arm).absolute_memory
    assert absolute(_case(arm, launch, bounded)) is (
        tiny_fraction(engine.fraction.default) and not engine.startup_reads_free_memory)  # fmt: skip
    assert not absolute(_case(arm, {**launch, engine.fraction.launch_key: 0.5}, bounded))
    assert not absolute(_case(arm, launch, KvBound()))
    # The fraction's launch key is one the arm is known to read (catalog sync accepts it).
    assert engine.fraction.launch_key in LAUNCH_KEYS[arm]


def test_the_vllm_defaults_differ_by_deployment_only_in_the_table() -> None:
    # vLLM's own pair takes 0.02 of the GPU, vLLM under Dynamo 0.01 (two engines and Dynamo's processes
    # share it); both bound the KV cache with the same flag and default.
    native, dynamo = ENGINES["vllm"], ARM_ROWS["dynamo"].entry("vllm")
    assert dynamo is ENGINES["dynamo-vllm"] and ARM_ROWS["dynamo"].entry("mocker") is None
    assert native.fraction is not None and dynamo.fraction is not None
    assert (native.fraction.default, dynamo.fraction.default) == (0.02, 0.01)
    assert (native.kv_flag, native.default_kv) == (dynamo.kv_flag, dynamo.default_kv)
