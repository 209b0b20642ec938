"""The traffic check on real reference pairs ([M27]): real processes, real HTTP on loopback, the real runner.

One profile (8 concurrent streams x 3 rounds, shared prefixes, prompts up to 200 words, n = 2 on every
fourth request, streaming and non-streaming mixed, logprobs) on a healthy pair and on pairs with the faults
that only concurrency shows. Each fault fails its cell with its class named; the healthy pair passes the same
cell, and every stream of it matched the aggregated twin's answer to its own prompt.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import cell_processes, port_still_held
from tests.helpers.reference_cells import Ran, run_reference_cases

PROFILE = (
    "{ streams = 8, rounds = 3, shared_prefix_tokens = 24, max_prompt_tokens = 200, n = 2, n_every = 4, "
    'stream = "mixed", logprobs = 2, bound_s = BOUND, kv_handoff_per_choice = true }'
)
# case -> (faults, the load's bound in seconds)
CASES = {
    "traffic_clean": ("[]", 30),
    "traffic_stale": ('["stale-kv-after-reuse"]', 30),
    "traffic_swap": ('["kv-swap-in-flight"]', 30),
    "traffic_n_child": ('["n-child-handoff-lost"]', 30),
    "traffic_hang": ('["peer-loss-hang"]', 3),
    # Every pulled request's last KV block corrupted: each stream's answer is wrong but nobody else's, which
    # is how a real engine's `swap` showed ([M28]: a partial exchange of blocks), caught as a divergence.
    "traffic_corrupt": ('["kv-corrupt-after-checksum"]', 30),
}




def _catalog() -> str:
    lines = []
    for name, (faults, bound) in CASES.items():
        lines += [
            "[[case]]",
            f'name = "{name}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0"]',
            # 2048 blocks of 64 bytes: a round (8 prompts of at most 200 words) fits, three rounds do not, so
            # the pool recycles blocks between rounds.
            "kv_bound = { bytes = 131072 }",
            "startup_timeout_s = 20\nrequest_timeout_s = 20",
            f"launch = {{ faults = {faults}, teardown_grace_s = 1, equivalence = {{ prompts = 2, tokens = 16 }} }}",
            f"traffic = {PROFILE.replace('BOUND', str(bound))}",
            "",
        ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    return run_reference_cases(tmp_path_factory.mktemp("traffic"), _catalog(), CASES, "traffic")


def test_a_healthy_pair_serves_every_stream_its_own_answer(runs: dict[str, Ran]) -> None:
    ran = runs["traffic_clean"]
    assert ran.status == "passed", ran.message
    document = json.loads((ran.log_dir / "traffic.json").read_text())
    assert document["failures"] == [] and len(document["requests"]) == 24
    assert {r["n"] for r in document["requests"]} == {1, 2} and {r["stream"] for r in document["requests"]} == {
        True,
        False,
    }
    assert all(len(r["choices"]) == r["n"] and not r["error"] for r in document["requests"])
    # The twin answered every traffic prompt, and the metrics are in the outcome.
    metrics = ran.peaks["traffic"]
    assert isinstance(metrics, dict) and metrics["requests"] == 24 and metrics["tokens_per_second"] > 0
    assert metrics["ttft_s"]["p50"] is not None and metrics["itl_s"]["p90"] is not None
    # A KV handoff per choice: 18 requests of one choice and 6 of two.
    assert metrics["kv_ledger"]["transfers"] == 30 and metrics["kv_ledger"]["source"].startswith("reference")


@pytest.mark.parametrize(
    ("case", "check"),
    [
        ("traffic_stale", "cross_request_contamination"),
        ("traffic_swap", "cross_request_contamination"),
        ("traffic_n_child", "traffic_n_choice"),
        ("traffic_hang", "traffic_hang"),
    ],
)
def test_each_concurrency_fault_fails_its_cell_with_its_class(runs: dict[str, Ran], case: str, check: str) -> None:
    ran = runs[case]
    assert ran.status == "failed" and check in ran.checks, ran.message
    # Only the traffic check sees it: the one request and the oracle's sequential prompts passed.
    assert "equivalent_to_aggregated" not in ran.checks and "http_status" not in ran.checks, ran.message


def test_streams_answered_wrong_but_by_no_other_prompt_fail_as_a_divergence(runs: dict[str, Ran]) -> None:
    """The positive control of `traffic_divergence`, the check that alone caught a real engine's `swap` (the
    healthy pair above is its negative control): a wrong answer that is no other stream's reference."""
    ran = runs["traffic_corrupt"]
    assert ran.status == "failed" and "traffic_divergence" in ran.checks, ran.message
    assert "cross_request_contamination" not in ran.checks, ran.message


def test_a_lost_child_handoff_shows_in_the_kv_ledger(runs: dict[str, Ran]) -> None:
    message = runs["traffic_n_child"].checks["traffic_kv_handoffs"]
    assert "the KV ledger counts 24 transfer(s) for 30 choices" in message, message


def test_the_hang_is_cut_within_its_bound_with_who_waited_on_what(runs: dict[str, Ran]) -> None:
    message = runs["traffic_hang"].checks["traffic_hang"]
    assert "unanswered after 3 s" in message and "who waited on what" in message


def test_nothing_is_left_behind(runs: dict[str, Ran]) -> None:
    for name, ran in runs.items():
        assert cell_processes(f"traffic-{name}") == []
        assert not any(port_still_held(p, f"traffic-{name}") for p in ran.ports)
