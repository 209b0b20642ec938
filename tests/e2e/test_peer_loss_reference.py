"""Peer loss and rejoin on real reference deployments ([M27]): real processes killed with SIGKILL under load,
started again, real HTTP on loopback, the real runner.

For each role in turn one worker is killed with streams in flight: every stream must end within the bound
(an error, or served whole), a request while it is down must end within the bound too (fail fast when no
worker of the role is left), survivors must release the dead peer's KV within the engine's own timeout, and
the worker, started again, must serve under its new instance id. Each way a frontend or an engine handles a
dead peer badly is a fault of the reference server, and each must fail the cell with its own class; the
same cells without the fault pass.
"""

from __future__ import annotations

import json

import pytest

from matrix.case_launch import ReferenceLaunch, parse_typed
from matrix.errors import ConfigError
from tests.helpers.processes import cell_processes, port_still_held
from tests.helpers.reference_cells import Ran, run_reference_cases

TRAFFIC = "{ streams = 4, rounds = 1, shared_prefix_tokens = 8, max_prompt_tokens = 32, bound_s = 20 }"
BOTH = "{ streams = 4, stream_tokens = 32, bound_s = 8, release_timeout_s = 8, rejoin_timeout_s = 30 }"
DECODE = '{ roles = ["decode"], streams = 4, stream_tokens = 32, bound_s = 8, release_timeout_s = 8 }'
STILL_ROUTED = ('{ roles = ["decode"], streams = 4, stream_tokens = 32, bound_s = 8, release_timeout_s = 8, '
                'rejoin_timeout_s = 3 }')  # fmt: skip
PREFILL = '{ roles = ["prefill"], streams = 4, stream_tokens = 32, bound_s = 8, release_timeout_s = 8 }'
# case -> (topology, faults, peer_loss table, token delay in ms)
CASES = {
    # Even 2 tokens without any delay were caught in flight (the kill follows the first token at once), so
    # the reference cannot show `peer_loss_not_exercised`; a slower answer only keeps the rounds readable.
    "peer_1p1d": ("", "[]", BOTH, 10),
    "peer_1p2d": ("1p2d", "[]", BOTH, 10),
    "peer_hang": ("", '["dead-peer-hang"]', PREFILL, 10),
    "peer_truncation": ("", '["dead-peer-truncation"]', DECODE, 10),
    "peer_never_rejoins": ("1p2d", '["dead-peer-never-rejoins"]', DECODE, 10),
    "peer_kv_held": ("", '["dead-peer-kv-held"]', DECODE, 10),
    "peer_still_routed": ("", '["dead-peer-still-routed"]', STILL_ROUTED, 10),
}




def _catalog() -> str:
    lines = []
    for name, (topology, faults, peer_loss, delay_ms) in CASES.items():
        shape = f'topology = "{topology}", ' if topology else ""
        lines += [
            "[[case]]",
            f'name = "{name}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0"]',
            "kv_bound = { bytes = 131072 }",
            "startup_timeout_s = 20\nrequest_timeout_s = 20",
            f"launch = {{ {shape}faults = {faults}, teardown_grace_s = 1, token_delay_ms = {delay_ms}, kv_ttl_s = 1, "
            f"peer_loss = {peer_loss}, equivalence = {{ prompts = 2, tokens = 8 }} }}",
            f"traffic = {TRAFFIC}" if topology else "",
            "",
        ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    return run_reference_cases(tmp_path_factory.mktemp("peer-loss"), _catalog(), CASES, "peer")


def _rounds(ran: Ran) -> list[dict[str, object]]:
    rounds: list[dict[str, object]] = json.loads((ran.log_dir / "peer_loss.json").read_text())["rounds"]
    return rounds


@pytest.mark.parametrize("case", ["peer_1p1d", "peer_1p2d"])
def test_each_role_loses_a_worker_under_load_and_it_rejoins(runs: dict[str, Ran], case: str) -> None:
    ran = runs[case]
    assert ran.status == "passed", ran.message
    rounds = _rounds(ran)
    assert [r["role"] for r in rounds] == ["prefill", "decode"]
    for record in rounds:
        # The kill took effect (SIGKILL, reaped) and the new process is another one, which served.
        assert record["exit_code"] == -9 and record["new_pid"] not in (None, record["pid"]), record
        assert record["rejoined_s"] is not None and record["new_instance_id"] is not None
        served = record["served_after_rejoin"]
        assert isinstance(served, list) and served[-1]["status_code"] == 200
        streams = record["streams"]
        assert isinstance(streams, list) and len(streams) == 4
        assert all(not s["before_kill"] and s["outcome"] in ("served", "error") for s in streams), streams
        assert record["released_s"] is not None and record["failures"] == []
        # Whole again at once: the run of requests after the restart was served, none refused.
        assert isinstance(record["whole_s"], float) and record["refused_after_rejoin"] == [], record
    decode_round = rounds[1]
    assert isinstance(decode_round["streams"], list)
    outcomes = [s["outcome"] for s in decode_round["streams"]]
    if case == "peer_1p1d":
        # The only decode died mid-answer: every stream says so with an error, and a new request fails fast.
        assert outcomes == ["error"] * 4
        assert [p["status_code"] for p in decode_round["down_probes"]] == [503]  # type: ignore[union-attr]
    else:
        # Round robin over two decodes: the survivor's streams were served whole, the dead one's erred.
        assert "served" in outcomes and "error" in outcomes
    # The deployment it rejoined answered the oracle's prompts as its aggregated twin does.
    assert "equivalent_to_aggregated" not in ran.checks


def test_a_frontend_that_waits_on_a_dead_peer_is_a_hang_with_who_waited(runs: dict[str, Ran]) -> None:
    ran = runs["peer_hang"]
    assert ran.status == "failed" and "peer_loss_hang" in ran.checks, ran.message
    message = ran.checks["peer_loss_hang"]
    assert "no other prefill worker was left: it must fail fast" in message and "who waited on what" in message


def test_a_stream_cut_and_served_as_whole_is_truncated(runs: dict[str, Ran]) -> None:
    ran = runs["peer_truncation"]
    assert ran.status == "failed" and set(ran.checks) == {"peer_loss_truncated"}, ran.message
    assert "ended as if complete (finish_reason 'length', no error)" in ran.checks["peer_loss_truncated"]


def test_a_worker_the_frontend_dropped_for_good_does_not_rejoin(runs: dict[str, Ran]) -> None:
    ran = runs["peer_never_rejoins"]
    assert ran.status == "failed" and set(ran.checks) == {"peer_loss_rejoin"}, ran.message
    assert "was ready, but none of 8 request(s) after it was served by it" in ran.checks["peer_loss_rejoin"]
    (record,) = _rounds(ran)
    assert record["new_pid"] != record["pid"] and record["new_instance_id"] is not None


def test_a_dead_workers_entry_still_routed_after_the_rejoin_fails_it(runs: dict[str, Ran]) -> None:
    """The restarted decode serves, but every other request still goes to the dead one's entry: the deployment
    is never whole again, which the rejoin rule names once `rejoin_timeout_s` (3 s) has passed."""
    ran = runs["peer_still_routed"]
    assert ran.status == "failed" and set(ran.checks) == {"peer_loss_rejoin"}, ran.message
    message = ran.checks["peer_loss_rejoin"]
    assert "requests were still refused" in message and "the router still sends some to the dead instance" in message
    (record,) = _rounds(ran)
    assert record["rejoined_s"] is not None and record["whole_s"] is None
    refused = record["refused_after_rejoin"]
    assert isinstance(refused, list) and refused and all(r["status_code"] == 503 for r in refused), refused


def test_kv_held_for_a_dead_decode_past_the_engines_timeout_fails(runs: dict[str, Ran]) -> None:
    ran = runs["peer_kv_held"]
    assert ran.status == "failed" and set(ran.checks) == {"peer_loss_kv_released"}, ran.message
    assert "prefill: KV usage" in ran.checks["peer_loss_kv_released"]
    # The same cell without the fault released it within the worker's 1 s TTL.
    (_, decode_round) = _rounds(runs["peer_1p1d"])
    assert isinstance(decode_round["released_s"], float) and decode_round["released_s"] < 8


@pytest.mark.parametrize(
    ("table", "refusal"),
    [
        ({"roles": ["frontend"]}, "roles"),
        ({"streams": 0}, "streams"),
        ({"bound_s": -1}, "bound_s"),
        ({"bound": 3}, r"has unknown key\(s\) bound"),
        ("yes", "must be true or a table"),
    ],
)
def test_a_malformed_peer_loss_table_is_refused_at_sync(table: object, refusal: str) -> None:
    with pytest.raises(ConfigError, match=refusal):
        parse_typed("reference", ReferenceLaunch, {"peer_loss": table})


def test_nothing_is_left_behind(runs: dict[str, Ran]) -> None:
    for name, ran in runs.items():
        assert cell_processes(f"peer-{name}") == []
        assert not any(port_still_held(p, f"peer-{name}") for p in ran.ports)
