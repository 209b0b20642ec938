"""One row per arm (`matrix.arm_table`): every other table of arms derives from it, and a case's memory facts are
computed from its row when the case is made, so the scheduler asks no arm for them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from matrix import pdproxy
from matrix.arm_table import (
    AGGREGATED_ARMS,
    ARM_ROWS,
    ARMS,
    LAUNCH_TYPES,
    PROTOCOLS,
    SHARED_ENGINE_ARMS,
    workspace_unvouched,
)
from matrix.campaign import HostHooks
from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import ConfigError
from matrix.executors import shared_engines
from matrix.executors.hooks import LocalHooks
from matrix.kv_bound import KvBound
from matrix.launch import options
from matrix.launch.arms import get_arm, known_arms
from matrix.launch.arms.base import AggregatedArm, LaunchContext
from matrix.markers import parse_marker_use


def _case(arm: str, launch: dict[str, object], bound: dict[str, int] | None = None) -> CaseInfo:
    return CaseInfo(name="c", backend="x", arm=arm, model="m", markers=(parse_marker_use("gpu_1"),),
                    launch=launch, kv_bound=KvBound.parse(bound or {}))  # fmt: skip


def test_every_table_of_arms_derives_from_the_rows() -> None:
    assert known_arms() == ARMS == set(ARM_ROWS) == set(LAUNCH_TYPES) == options.ARMS
    assert options.AGGREGATED_ARMS == AGGREGATED_ARMS == {"reference", "vllm_native"}
    assert {name for name in ARMS if isinstance(get_arm(name), AggregatedArm)} == AGGREGATED_ARMS
    assert shared_engines.SHARED_ENGINE_ARMS is SHARED_ENGINE_ARMS == {"vllm_native"}
    assert set(options.LAUNCH_KEYS) == ARMS
    # The proxy speaks exactly the rows' protocols, vLLM's (the request as is) first: its default.
    assert pdproxy.PROTOCOLS is PROTOCOLS == ("vllm", "sglang")
    for name, row in ARM_ROWS.items():
        assert get_arm(name).name == name and row.launch_type is LAUNCH_TYPES[name]
        for engine in row.engines:
            assert row.entry(engine) is not None or engine == "mocker", f"{name}: {engine} has no engine entry"


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_a_row_protocol_is_what_its_plan_starts_the_proxy_with(arm: str, tmp_path: Path) -> None:
    case = _case(arm, {})
    ports = {req.name: 23000 + i for i, req in enumerate(get_arm(arm).port_requests(case))}
    ctx = LaunchContext("cell1", case, RuntimeInfo("x", "1.0", "v1.0"), ports, tmp_path, python="/py",
                        gpu_ids=("0",), model_dir=tmp_path)  # fmt: skip
    proxies = [p.argv for p in get_arm(arm).plan(ctx).processes if "matrix.pdproxy" in p.argv]
    protocols = [argv[argv.index("--protocol") + 1] if "--protocol" in argv else PROTOCOLS[0] for argv in proxies]
    assert protocols == ([ARM_ROWS[arm].protocol] if ARM_ROWS[arm].protocol else [])


# (arm, launch, bound, runs_on_cpu, absolute_memory): the arms' own answers before the facts moved to the rows.
FACTS = [
    ("reference", {}, None, True, False),
    ("reference", {}, {"bytes": 1 << 20}, True, True),
    ("reference", {"device": "cuda"}, {"bytes": 1 << 20}, False, True),
    ("reference", {}, {"tokens": 64}, True, False),  # a bound in another unit bounds nothing
    ("vllm_native", {}, {"bytes": 1 << 28}, False, True),
    ("vllm_native", {"cpu": True}, None, True, False),
    ("vllm_native", {"gpu_memory_utilization": 0.5}, {"bytes": 1 << 28}, False, False),
    # SGLang's start-up checks its fraction against free memory measured around its weight load: bounded, but
    # never overlapping other start-ups (`Engine.startup_reads_free_memory`).
    ("sglang_native", {}, {"tokens": 2048}, False, False),
    ("sglang_native", {"mem_fraction_static": 0.5}, {"tokens": 2048}, False, False),
    ("dynamo", {}, None, True, True),  # the mocker: no GPU memory at all
    ("dynamo", {"engine": "vllm"}, {"bytes": 1 << 28}, False, True),
    ("dynamo", {"engine": "vllm", "cpu": True}, {"bytes": 1 << 28}, True, True),
    ("dynamo", {"engine": "vllm", "script": "launch.sh"}, {"bytes": 1 << 28}, False, False),
    # A workspace script runs only under `run --workspace`: the run decides (`workspace_unvouched`).
    ("dynamo", {"engine": "vllm", "workspace_script": "a.sh"}, {"bytes": 1 << 28}, False, True),
    ("dynamo", {"engine": "sglang"}, {"tokens": 2048}, False, False),
    ("dynamo", {"engine": "trtllm", "script": "t.sh"}, {"tokens": 2048}, False, False),
]


@pytest.mark.parametrize(("arm", "launch", "bound", "cpu", "absolute"), FACTS)
def test_the_memory_facts_come_with_the_case(
    arm: str, launch: dict[str, object], bound: dict[str, int] | None, cpu: bool, absolute: bool
) -> None:
    case = _case(arm, launch, bound)
    assert (case.runs_on_cpu, case.absolute_memory) == (cpu, absolute)
    # The arms answer from the same facts (the runner still asks its arm whether the cell may run on CPU).
    assert (get_arm(arm).runs_on_cpu(case), get_arm(arm).absolute_memory(case)) == (cpu, absolute)


def test_a_replaced_case_gets_its_own_facts_and_an_unknown_engine_the_cautious_ones() -> None:
    unbounded = _case("vllm_native", {})
    assert not unbounded.absolute_memory
    assert dataclasses.replace(unbounded, kv_bound=KvBound(bytes=1 << 28)).absolute_memory
    # A case no row runs still makes a cell (a GPU slot, start-ups one at a time); the arm refuses it loudly.
    bogus = _case("dynamo", {"engine": "bogus"})
    assert (bogus.runs_on_cpu, bogus.absolute_memory) == (False, False)
    with pytest.raises(ConfigError, match="bogus"):
        get_arm("dynamo").runs_on_cpu(bogus)
    stranger = _case("no_such_arm", {})
    assert (stranger.runs_on_cpu, stranger.absolute_memory) == (False, False)


def test_the_scheduler_asks_the_launch_floor_for_no_memory_fact() -> None:
    for hooks in (HostHooks, LocalHooks):
        assert not hasattr(hooks, "runs_on_cpu") and not hasattr(hooks, "absolute_memory")


def test_a_workspace_script_is_unvouched_only_when_the_run_hands_it_the_engines() -> None:
    # The seed's sidecar cells started one at a time (10.8x one cell on the H200) for a script that runs
    # only under --workspace; without the option matrix starts the engines with the case's own bounds.
    case = _case("dynamo", {"engine": "vllm", "workspace_script": "a.sh"}, {"bytes": 1 << 28})
    assert case.absolute_memory
    assert workspace_unvouched(case.launch, Path("/checkout"))
    assert not workspace_unvouched(case.launch, None)
    assert not workspace_unvouched(_case("dynamo", {"engine": "sglang"}, {"tokens": 2048}).launch, Path("/checkout"))
