"""What an arm launches for the equivalence oracle: the pair's plan and its aggregated plan carry the
oracle's spec; the aggregated instance has the pair's engine flags and seed, its own ports, no KV connector;
`launch.equivalence` is checked with messages that name the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import ConfigError
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import AggregatedArm, LaunchContext, equivalence_options
from matrix.launch.launch_plan import LaunchPlan
from matrix.launch.options import EQUIVALENCE_DEFAULTS
from matrix.markers import parse_marker_use
from matrix.pdproxy import ProxyApp, ProxyConfig
from matrix.reference.eventlog import EventLog
from matrix.reference.frontend import parse_upstream
from tests.helpers.cli import Matrix


def _case(arm: str, launch: dict[str, Any]) -> CaseInfo:
    return CaseInfo(
        name="eq", backend="vllm", arm=arm, model="tiny", markers=(parse_marker_use("gpu_0"),), launch=launch,
        kv_bound=KvBound(bytes=268435456), request_timeout_s=42,
    )  # fmt: skip


def _plans(tmp_path: Path, arm_name: str, launch: dict[str, Any]) -> tuple[LaunchPlan, LaunchPlan]:
    case = _case(arm_name, launch)
    arm = get_arm(arm_name)
    assert isinstance(arm, AggregatedArm)
    pair_ports = {r.name: 30000 + i for i, r in enumerate(arm.port_requests(case))}
    agg_ports = {r.name: 31000 + i for i, r in enumerate(arm.aggregated_port_requests(case))}
    assert not set(pair_ports) & set(agg_ports)  # one ports mapping holds both in the outcome
    runtime = RuntimeInfo("vllm", "0.32.0", "v0.32.0")

    def ctx(ports: dict[str, int]) -> LaunchContext:
        return LaunchContext("cell7", case, runtime, ports, tmp_path, python="/rt/python", model_dir=tmp_path / "m",
                             matrix_python="/matrix/python", cpu_ids=(0, 1, 2, 3))  # fmt: skip

    return arm.plan(ctx(pair_ports)), arm.aggregated_plan(ctx(agg_ports))


def test_vllm_aggregated_instance_has_the_pairs_flags_and_seed_without_a_connector(tmp_path: Path) -> None:
    launch = {"cpu": True, "extra_args": ["--dtype", "bfloat16"], "equivalence": {"seed": 5, "prompts": 4}}
    pair, agg = _plans(tmp_path, "vllm_native", launch)
    (instance,) = agg.processes
    argv = list(instance.argv)
    assert instance.role == "aggregated" and "--kv-transfer-config" not in argv
    assert argv[argv.index("--port") + 1] == str(agg.ports["aggregated_http"])
    decode = list(pair.processes[1].argv)
    connector = decode.index("--kv-transfer-config")
    without = decode[:connector] + decode[connector + 2 :]
    # Same flags as the decode instance but the port and the connector: the model, caps, seed, extra args.
    assert [a for a in without if a != str(pair.ports["decode_http"])] == [
        a for a in argv if a != str(agg.ports["aggregated_http"])
    ]
    assert argv[argv.index("--seed") + 1] == "5" and argv[-2:] == ["--dtype", "bfloat16"]
    assert instance.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3"  # alone on the host: every CPU
    assert pair.oracle is not None and agg.oracle is not None
    assert pair.oracle.url == f"http://127.0.0.1:{pair.ports['proxy']}/v1/completions"
    assert agg.oracle.url == f"http://127.0.0.1:{agg.ports['aggregated_http']}/v1/completions"
    assert (agg.oracle.prompts, agg.oracle.tokens, agg.oracle.timeout_s) == (4, 64, 42)
    assert agg.ready_probes[0].require_models and agg.scratch_dirs == pair.scratch_dirs


def test_a_case_without_equivalence_launches_as_before(tmp_path: Path) -> None:
    pair, _ = _plans(tmp_path, "vllm_native", {"cpu": True})
    assert pair.oracle is None
    assert all("--seed" not in p.argv for p in pair.processes)


def test_reference_aggregated_deployment_is_one_worker_behind_a_frontend(tmp_path: Path) -> None:
    pair, agg = _plans(tmp_path, "reference", {"faults": ["kv-corrupt-after-checksum"], "equivalence": True})
    worker, frontend = agg.processes
    assert worker.argv[worker.argv.index("--role") + 1] == "aggregated"
    assert frontend.argv[frontend.argv.index("--aggregated-url") + 1] == (
        f"http://127.0.0.1:{agg.ports['aggregated_http']}"
    )
    # The same fault set reaches both deployments; the aggregated worker has no transfer to corrupt.
    assert worker.env["MATRIX_REFERENCE_FAULTS"] == pair.processes[1].env["MATRIX_REFERENCE_FAULTS"]
    assert pair.oracle is not None and pair.oracle.prompts == EQUIVALENCE_DEFAULTS["prompts"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", "must be true or a table"),
        ({"prompt": 3}, "unknown key.*prompt; known: prompts, tokens, near_tie_gap, seed"),
        ({"prompts": 0}, "prompts must be an integer from 1 to 4096"),
        ({"tokens": True}, "tokens must be an integer"),
        ({"near_tie_gap": -1}, "near_tie_gap must be a number >= 0"),
        ({"seed": -2}, "seed must be an integer >= 0"),
    ],
)
def test_bad_equivalence_options_are_refused_with_the_fix(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=f"case eq: launch.equivalence.*{message}"):
        equivalence_options(_case("reference", {"equivalence": value}))


def test_equivalence_options_default_and_opt_out() -> None:
    assert equivalence_options(_case("reference", {})) is None
    assert equivalence_options(_case("reference", {"equivalence": False})) is None
    assert equivalence_options(_case("reference", {"equivalence": True})) == EQUIVALENCE_DEFAULTS
    assert equivalence_options(_case("reference", {"equivalence": {"tokens": 8}}))["tokens"] == 8  # type: ignore[index]


def test_arms_without_an_aggregated_deployment_say_so() -> None:
    assert not isinstance(get_arm("dynamo"), AggregatedArm)
    assert not isinstance(get_arm("sglang_native"), AggregatedArm)


def test_the_pd_proxy_routes_plain_completions_like_chat() -> None:
    up = parse_upstream("prefill", "http://127.0.0.1:9")
    routes = ProxyApp(ProxyConfig(1, up, up, 1.0), EventLog("test")).routes()
    assert ("POST", "/v1/completions") in routes


CASE = """
[[case]]
name = "eq_bad"
backend = "{backend}"
arm = "{arm}"
model = "tiny"
markers = ["gpu_0"]
launch = {{ equivalence = {value} }}
"""


@pytest.mark.parametrize(
    ("backend", "arm", "value", "needle"),
    [
        ("reference", "reference", "{ tokenz = 8 }", "launch.equivalence has unknown key(s) tokenz"),
        ("reference", "reference", "{ near_tie_gap = -0.5 }", "near_tie_gap must be a number >= 0"),
        ("vllm", "dynamo", "true", "arm dynamo cannot launch an aggregated instance"),
    ],
)
def test_catalog_sync_refuses_bad_equivalence_and_changes_nothing(
    seeded: Matrix, tmp_path: Path, backend: str, arm: str, value: str, needle: str
) -> None:
    bad = tmp_path / "eq.toml"
    bad.write_text(CASE.format(backend=backend, arm=arm, value=value))
    before = seeded.dump()
    result = seeded("catalog", "sync", str(bad))
    assert result.exit_code == 2, result.output
    assert needle in result.output and "eq_bad" in result.output
    assert seeded.dump() == before


def test_the_arm_names_catalog_sync_checks_are_the_registry() -> None:
    from matrix.launch.arms import known_arms
    from matrix.launch.options import AGGREGATED_ARMS, ARMS

    assert known_arms() == ARMS
    assert {name for name in ARMS if isinstance(get_arm(name), AggregatedArm)} == AGGREGATED_ARMS
