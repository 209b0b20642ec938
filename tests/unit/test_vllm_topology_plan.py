"""[M27] the vllm_native arm's xPyD plan: one `vllm serve` per worker with its own ports and side channel, the
proxy given every worker, and a `TopologySpec` whose ids come from the proxy and whose ledger is each decode's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from matrix.cells import CaseInfo, RuntimeInfo
from matrix.errors import ConfigError
from matrix.kv_bound import KvBound
from matrix.launch.arms import get_arm
from matrix.launch.arms.base import LaunchContext
from matrix.launch.arms.vllm_native import DECODE_COUNTERS
from matrix.launch.launch_plan import LaunchPlan
from matrix.markers import parse_marker_use
from matrix.traffic_profile import parse_traffic


def _plan(tmp_path: Path, launch: dict[str, object]) -> LaunchPlan:
    case = CaseInfo(
        name="v", backend="vllm-cpu", arm="vllm_native", model="tiny", markers=(parse_marker_use("gpu_0"),),
        launch=launch, kv_bound=KvBound(bytes=67108864),
    )  # fmt: skip
    arm = get_arm("vllm_native")
    ports = {r.name: 30000 + i for i, r in enumerate(arm.port_requests(case))}
    ctx = LaunchContext("cell9", case, RuntimeInfo("vllm-cpu", "0.32.0", "v0.32.0"), ports, tmp_path,
                        python="/rt/python", model_dir=tmp_path / "model", matrix_python="/matrix/python",
                        cpu_ids=(0, 1))  # fmt: skip
    return arm.plan(ctx)


def _flag(argv: tuple[str, ...], flag: str) -> list[str]:
    return [argv[i + 1] for i, part in enumerate(argv) if part == flag]


def test_2p1d_starts_every_worker_on_its_own_ports_behind_one_proxy(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"cpu": True, "topology": "2p1d"})
    roles = [p.role for p in plan.processes]
    assert roles == ["prefill", "decode", "prefill_2", "proxy"]
    engines = {p.role: p for p in plan.processes if p.role != "proxy"}
    http = {role: int(_flag(p.argv, "--port")[0]) for role, p in engines.items()}
    side = {role: p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for role, p in engines.items()}
    assert len(set(http.values())) == len(set(side.values())) == 3
    assert http["prefill_2"] == plan.ports["prefill_2_http"]
    assert side["prefill_2"] == str(plan.ports["prefill_2_side_channel"])
    for role, p in engines.items():
        config = json.loads(_flag(p.argv, "--kv-transfer-config")[0])
        assert config["kv_role"] == ("kv_producer" if role.startswith("prefill") else "kv_consumer")
    # Both prefills share the prefill half of the CPUs, the decode has the other.
    assert [engines[r].env["VLLM_CPU_OMP_THREADS_BIND"] for r in ("prefill", "prefill_2", "decode")] == ["0", "0", "1"]
    proxy = plan.processes[-1].argv
    urls = {role: f"http://127.0.0.1:{port}" for role, port in http.items()}
    assert _flag(proxy, "--prefill-url") == [urls["prefill"], urls["prefill_2"]]
    assert _flag(proxy, "--decode-url") == [urls["decode"]] and "--worker-ids" in proxy
    spec = plan.topology
    assert spec is not None and spec.topology == "2p1d" and spec.decode_counters == DECODE_COUNTERS
    assert [(w.name, w.role) for w in spec.workers] == [("prefill", "prefill"), ("decode", "decode"),
                                                         ("prefill_2", "prefill")]  # fmt: skip
    proxy_port = plan.ports["proxy"]
    assert spec.workers[2].health_url == f"http://127.0.0.1:{proxy_port}/workers/prefill_2/health"
    assert spec.workers[1].metrics_url == f"http://127.0.0.1:{http['decode']}/metrics"
    assert plan.lifecycle is not None
    assert [g.role for g in plan.lifecycle.engines] == ["prefill", "decode", "prefill_2"]


def test_a_pair_without_topology_has_no_topology_spec_and_no_extra_proxy_flags(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"cpu": True})
    assert [p.role for p in plan.processes] == ["prefill", "decode", "proxy"] and plan.topology is None
    proxy = plan.processes[-1].argv
    assert len(_flag(proxy, "--prefill-url")) == len(_flag(proxy, "--decode-url")) == 1 and "--worker-ids" not in proxy


def test_a_bad_topology_is_refused_at_sync(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not an xPyD topology"):
        _plan(tmp_path, {"cpu": True, "topology": "3x1"})


def test_peer_loss_on_the_pair_asks_the_proxy_for_worker_ids_and_reads_vllm_gauges(tmp_path: Path) -> None:
    """[M27] peer loss on a 1P1D pair: the check learns each instance's id from the proxy (`--worker-ids`, which
    the pair otherwise does without) and watches every instance's own vLLM scheduler gauges."""
    plan = _plan(tmp_path, {"cpu": True, "peer_loss": {"roles": ["decode"], "bound_s": 20}})
    assert [p.role for p in plan.processes] == ["prefill", "decode", "proxy"] and plan.topology is None
    assert "--worker-ids" in plan.processes[-1].argv
    spec = plan.peer_loss
    assert spec is not None and spec.roles == ("decode",) and spec.bound_s == 20.0 and spec.streams == 4
    proxy_port = plan.ports["proxy"]
    assert [(w.name, w.role, w.health_url) for w in spec.workers] == [
        (name, name, f"http://127.0.0.1:{proxy_port}/workers/{name}/health") for name in ("prefill", "decode")]
    assert [(g.role, g.url, g.running, g.kv_usage) for g in spec.gauges] == [
        (name, f"http://127.0.0.1:{plan.ports[name + '_http']}/metrics", "vllm:num_requests_running",
         "vllm:kv_cache_usage_perc") for name in ("prefill", "decode")]  # fmt: skip
    assert spec.record_dir == str(tmp_path)


def test_peer_loss_covers_every_worker_of_a_topology(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"cpu": True, "topology": "1p2d", "peer_loss": True})
    assert plan.peer_loss is not None and [w.name for w in plan.peer_loss.workers] == ["prefill", "decode", "decode_2"]
    assert list(plan.processes[-1].argv).count("--worker-ids") == 1


@pytest.mark.parametrize("bad", [{"roles": ["router"]}, {"streams": 0}, {"bound_s": "soon"}, {"ttl": 3}, "yes"])
def test_a_bad_peer_loss_table_is_refused_at_sync(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="peer_loss"):
        _plan(tmp_path, {"cpu": True, "peer_loss": bad})


def test_a_topology_without_a_load_sends_a_request_per_pair_of_its_own(tmp_path: Path) -> None:
    """A peer-loss case's topology has no traffic table: the topology check itself puts every pair to work
    (without it, 1p2d's second decode served nothing and the cell failed `topology_worker_unused`)."""
    for topology, pairs in (("1p2d", 2), ("2p2d", 4)):
        spec = _plan(tmp_path, {"cpu": True, "topology": topology, "peer_loss": True}).topology
        assert spec is not None and spec.requests == pairs
    case = CaseInfo(name="v", backend="vllm-cpu", arm="vllm_native", model="tiny", markers=(),
                    launch={"cpu": True, "topology": "1p2d"}, traffic=parse_traffic({"streams": 4, "rounds": 2}))
    arm = get_arm("vllm_native")
    ports = {r.name: 30000 + i for i, r in enumerate(arm.port_requests(case))}
    ctx = LaunchContext("cell9", case, RuntimeInfo("vllm-cpu", "0.32.0", "v0.32.0"), ports, tmp_path,
                        python="/rt/python", model_dir=tmp_path / "model", matrix_python="/matrix/python")  # fmt: skip
    loaded = arm.plan(ctx).topology
    assert loaded is not None and loaded.requests == 0  # the load's streams reach every pair
