"""xPyD topologies on real reference deployments ([M27]): real processes, real HTTP on loopback, the real runner.

Several prefill and decode workers behind one frontend, which routes round robin across them, under a small
traffic load. The cell passes only if every worker served, KV moved on every (prefill, decode) pair used (the
decode's ledger per prefill peer) and every stream passed the oracle. The positive control: a frontend that
never routes to its last decode fails the same 1p2d cell with `topology_worker_unused`.
"""

from __future__ import annotations

import json

import pytest

from matrix.case_launch import ReferenceLaunch, parse_typed
from matrix.errors import ConfigError
from tests.helpers.processes import cell_processes, port_still_held
from tests.helpers.reference_cells import Ran, run_reference_cases

PROFILE = (
    "{ streams = 4, rounds = 2, shared_prefix_tokens = 8, max_prompt_tokens = 48, n = 2, n_every = 4, "
    'stream = "mixed", logprobs = 2, bound_s = 20, kv_handoff_per_choice = true }'
)
# case -> (topology, faults, with a traffic table)
CASES = {
    "topo_1p2d": ("1p2d", "[]", True),
    "topo_2p1d": ("2p1d", "[]", True),
    "topo_2p2d": ("2p2d", "[]", True),
    "topo_1p2d_unused": ("1p2d", '["topology-decode-unused"]', True),
    "topo_1p2d_no_traffic": ("1p2d", "[]", False),
}




def _catalog() -> str:
    lines = []
    for name, (topology, faults, traffic) in CASES.items():
        lines += [
            "[[case]]",
            f'name = "{name}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0"]',
            "kv_bound = { bytes = 131072 }",
            "startup_timeout_s = 20\nrequest_timeout_s = 20",
            f'launch = {{ topology = "{topology}", faults = {faults}, teardown_grace_s = 1, '
            "equivalence = { prompts = 2, tokens = 8 } }",
            f"traffic = {PROFILE}" if traffic else "",
            "",
        ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    return run_reference_cases(tmp_path_factory.mktemp("topology"), _catalog(), CASES, "topology")


def _record(ran: Ran) -> dict[str, object]:
    document: dict[str, object] = json.loads((ran.log_dir / "topology.json").read_text())
    return document


@pytest.mark.parametrize("case", ["topo_1p2d", "topo_2p1d", "topo_2p2d"])
def test_every_worker_serves_and_every_pair_moves_kv(runs: dict[str, Ran], case: str) -> None:
    prefills, decodes = (int(CASES[case][0][i]) for i in (0, 2))
    ran = runs[case]
    assert ran.status == "passed", ran.message
    record = _record(ran)
    workers = record["workers"]
    assert isinstance(workers, list)
    roles = [w["role"] for w in workers]
    assert roles.count("prefill") == prefills and roles.count("decode") == decodes
    assert len({w["instance_id"] for w in workers}) == prefills + decodes
    assert all(w["served"] > 0 for w in workers), workers
    pairs = record["pairs"]
    assert isinstance(pairs, list) and len(pairs) == prefills * decodes  # round robin reaches every pair
    assert all(p["kv_transfers"] >= p["choices"] > 0 and p["kv_bytes"] > 0 for p in pairs), pairs
    # Every stream of the load also passed the oracle (the traffic check of the same cell).
    traffic = json.loads((ran.log_dir / "traffic.json").read_text())
    assert traffic["failures"] == [] and len(traffic["requests"]) == 8


def test_a_decode_never_routed_to_fails_the_cell_by_name(runs: dict[str, Ran]) -> None:
    ran = runs["topo_1p2d_unused"]
    assert ran.status == "failed" and set(ran.checks) == {"topology_worker_unused"}, ran.message
    assert "decode worker decode_2" in ran.checks["topology_worker_unused"]
    # The same cell without the fault passes (topo_1p2d), and the streams themselves were right.
    assert json.loads((ran.log_dir / "traffic.json").read_text())["failures"] == []


def test_a_topology_without_traffic_says_it_needs_a_load(runs: dict[str, Ran]) -> None:
    ran = runs["topo_1p2d_no_traffic"]
    assert ran.status == "failed" and "topology_worker_unused" in ran.checks, ran.message
    assert "needs a `traffic` table" in ran.checks["topology_worker_unused"]


@pytest.mark.parametrize("bad", ["1x2d", "0p1d", "1p5d", "p2d"])
def test_a_malformed_topology_is_refused_at_sync(bad: str) -> None:
    with pytest.raises(ConfigError, match="not an xPyD topology"):
        parse_typed("reference", ReferenceLaunch, {"topology": bad})


def test_nothing_is_left_behind(runs: dict[str, Ran]) -> None:
    for name, ran in runs.items():
        assert cell_processes(f"topology-{name}") == []
        assert not any(port_still_held(p, f"topology-{name}") for p in ran.ports)
