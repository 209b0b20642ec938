"""Per-role overrides of a case's launch options ([M20] item 3): checked at catalog sync, launched per role.

The block size per side (vllm#42895's shape) and NixlConnector's handshake check, on one side or both, reach
exactly the `vllm serve` of the role they name; a value vLLM on a CPU cannot take, an unknown role or a key no
role may override is refused with the fix before the database is touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from matrix.arm_table import parse_launch
from matrix.case_launch import VllmNativeLaunch, for_role
from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.options import check_case_options
from tests.helpers.cli import DATA, Matrix


def _plan(launch: dict[str, object], tmp_path: Path, aggregated: bool = False) -> LaunchPlan:
    case = CaseInfo("c", "vllm-cpu", "vllm_native", "tiny", (), launch=launch)
    arm = get_arm(case.arm)
    requests = arm.aggregated_port_requests(case) if aggregated else arm.port_requests(case)
    ports = {req.name: 20000 + i for i, req in enumerate(requests)}
    ctx = LaunchContext("c1", case, RuntimeInfo("vllm-cpu", "0.32.0", "v0.32.0"), ports, tmp_path, python="python")
    return arm.aggregated_plan(ctx) if aggregated else arm.plan(ctx)  # type: ignore[attr-defined,no-any-return]


def _flag(plan: LaunchPlan, role: str, flag: str) -> str | None:
    argv = list(next(p for p in plan.processes if p.role == role).argv)
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_a_role_runs_its_own_block_size_and_the_other_the_cases(tmp_path: Path) -> None:
    plan = _plan({"cpu": True, "block_size": 32, "role_launch": {"decode": {"block_size": 64}}}, tmp_path)
    assert _flag(plan, "prefill", "--block-size") == "32"
    assert _flag(plan, "decode", "--block-size") == "64"
    # The oracle's aggregated baseline serves as decode does.
    assert _flag(_plan({"cpu": True, "role_launch": {"decode": {"block_size": 64}}}, tmp_path, True),
                 "aggregated", "--block-size") == "64"  # fmt: skip
    # No key: vLLM's own default, no flag at all.
    assert _flag(_plan({"cpu": True}, tmp_path), "decode", "--block-size") is None


def test_the_handshake_check_goes_into_the_connectors_extra_config_of_each_side_asked(tmp_path: Path) -> None:
    both = _plan({"cpu": True, "enforce_handshake_compat": False}, tmp_path)
    one = _plan({"cpu": True, "role_launch": {"prefill": {"enforce_handshake_compat": False}}}, tmp_path)
    default = _plan({"cpu": True}, tmp_path)

    def extra(plan: LaunchPlan, role: str) -> object:
        return json.loads(_flag(plan, role, "--kv-transfer-config") or "{}").get("kv_connector_extra_config")

    assert extra(both, "prefill") == extra(both, "decode") == {"enforce_handshake_compat": False}
    assert (extra(one, "prefill"), extra(one, "decode")) == ({"enforce_handshake_compat": False}, None)
    assert extra(default, "prefill") is None and extra(default, "decode") is None


def test_for_role_applies_only_that_roles_overrides() -> None:
    launch = parse_launch("vllm_native", {"block_size": 32, "role_launch": {"prefill": {"block_size": 128}}})
    assert isinstance(launch, VllmNativeLaunch)
    assert for_role(launch, "prefill").block_size == 128
    assert for_role(launch, "decode").block_size == 32
    assert for_role(launch, "decode") is launch


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        ({"cpu": True, "block_size": 16}, "launch.block_size = 16: vLLM on a CPU takes block sizes that are multiples"),
        ({"cpu": True, "role_launch": {"decode": {"block_size": 48}}}, "launch.role_launch.decode.block_size = 48"),
        ({"role_launch": {"frontend": {"block_size": 32}}}, "names role 'frontend'; the vllm_native arm's roles"),
        ({"role_launch": {"decode": {"max_model_len": 64}}}, "role_launch.decode.max_model_len cannot be set per role"),
        ({"role_launch": {"decode": {"block_size": "64"}}}, "role_launch.decode.block_size must be an integer"),
        ({"role_launch": {"decode": 64}}, "launch.role_launch must be a table of launch keys per role"),
        ({"enforce_handshake_compat": "no"}, "launch.enforce_handshake_compat must be true or false"),
    ],
)  # fmt: skip
def test_bad_overrides_are_refused_with_the_fix(launch: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_case_options("vllm_native", launch, {}, [])


def test_a_gpu_case_may_use_any_block_size() -> None:
    # The multiple-of-32 rule is vLLM's CPU attention's; CUDA vLLM takes 16 (vllm#42895's prefill).
    check_case_options("vllm_native", {"block_size": 16, "role_launch": {"decode": {"block_size": 32}}}, {}, [])


def test_catalog_sync_refuses_a_bad_override_and_changes_nothing(tmp_path: Path) -> None:
    m = Matrix(home=tmp_path, db_path=tmp_path / "matrix.db")
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[[case]]\nname = "odd_blocks"\nbackend = "vllm-cpu"\narm = "vllm_native"\nmodel = "tiny"\n'
        'markers = ["gpu_0"]\nlaunch = { cpu = true, role_launch = { decode = { block_size = 40 } } }\n'
    )
    files = [str(DATA / n) for n in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")]
    result = m("catalog", "sync", *files, str(bad))
    assert result.exit_code == 2, result.output
    assert "launch.role_launch.decode.block_size = 40" in result.output and "multiples of 32" in result.output
    assert not m.exists() or "odd_blocks" not in m.dump()
