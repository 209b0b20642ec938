"""[M30] item 4: insufficient data is a class per case and metric in `compare` and in the gate's
`max_slowdown` rule (too few samples, or a 95 % interval of the ratio that straddles the threshold), never
"unchanged" and never a silent pass; on attempts written straight into the database."""

from __future__ import annotations

import json
import math
import random

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync

pytest.importorskip("scipy")

CASES = ("vllm_agg_check", "vllm_long_prompt", "vllm_disaggregated")

GATES = """
[[gate]]
name = "speed"
expression = "(pre_merge or post_merge) and e2e"
rules = { max_slowdown = 0.10, perf_alpha = 0.01 }

[[gate]]
name = "speed_strict"
expression = "(pre_merge or post_merge) and e2e"
rules = { max_slowdown = 0.10, perf_alpha = 0.01, insufficient_blocks = true }
"""


def runs(m: Matrix, spec: str, count: int, scale: float = 1.0, seed: int = 0) -> None:
    """`count` passed attempts of each case, request times around 0.1 s times `scale`."""
    rng = random.Random(seed)
    with db(m) as s:
        camp = campaign(s)
        for case in CASES:
            for number in range(1, count + 1):
                request = scale * 0.1 * math.exp(rng.gauss(0, 0.05))
                attempt(s, camp, case, spec, "passed", attempt_no=number, request_s=request, ttft_s=request / 2,
                        ready_s=1.0 * math.exp(rng.gauss(0, 0.05)), completion_tokens=16)  # fmt: skip


def _gate(m: Matrix, policy: str) -> tuple[int, dict[str, object]]:
    result = m("gate", "vllm", "0.30.0", "--policy", policy, "--json")
    return result.exit_code, json.loads(result.output)


def _insufficient(data: dict[str, object]) -> dict[str, str]:
    return {r["case"]: r["message"] for r in data["reasons"] if r["kind"] == "insufficient-data"}  # type: ignore[attr-defined]


def test_one_sample_a_side_is_insufficient_data_reported_or_incomplete(matrix: Matrix) -> None:
    sync(matrix, GATES)
    runs(matrix, "vllm=0.29.0", 1, seed=1)
    runs(matrix, "vllm=0.30.0", 1, seed=2)
    code, data = _gate(matrix, "speed")
    assert code == 0 and data["verdict"] == "GO", data
    found = _insufficient(data)
    assert set(found) == set(CASES), data["reasons"]
    message = found["vllm_agg_check"]
    assert "request_s x" in message and "too few samples: n=1/1, needs 2+ a side" in message
    assert "reported, not blocking" in message
    text = matrix("gate", "vllm", "0.30.0", "--policy", "speed").output
    assert "insufficient-data" in text and "insufficient_blocks no" in text
    # Under insufficient_blocks the same evidence is missing evidence: INCOMPLETE, never GO.
    code, data = _gate(matrix, "speed_strict")
    assert code == 3 and data["verdict"] == "INCOMPLETE", data
    assert all(r["blocking"] for r in data["reasons"] if r["kind"] == "insufficient-data")  # type: ignore[attr-defined]

    compared = json.loads(matrix("compare", "vllm=0.29.0", "vllm=0.30.0", "--json").output)
    row = next(c for c in compared["cases"] if c["case"] == "vllm_agg_check")
    assert row["verdict"] == "insufficient data", row
    request = next(p for p in row["performance"] if p["metric"] == "request_s")
    assert request["class"] == "insufficient data" and request["insufficient"].startswith("too few samples")


def test_an_interval_straddling_the_threshold_is_insufficient_not_unchanged(matrix: Matrix) -> None:
    """Three samples a side, about 10 % slower: the interval holds both "within 10 %" and "worse"."""
    sync(matrix, GATES)
    runs(matrix, "vllm=0.29.0", 3, seed=1)
    runs(matrix, "vllm=0.30.0", 3, scale=1.1, seed=2)
    code, data = _gate(matrix, "speed")
    assert code == 0, data
    message = _insufficient(data)["vllm_agg_check"]
    assert "request_s x1." in message and "straddles the threshold x1.100" in message, message
    compared = json.loads(matrix("compare", "vllm=0.29.0", "vllm=0.30.0", "--json").output)
    row = next(c for c in compared["cases"] if c["case"] == "vllm_agg_check")
    request = next(p for p in row["performance"] if p["metric"] == "request_s")
    assert row["verdict"] == "insufficient data" and request["class"] == "insufficient data", row
    assert request["ratio_low"] <= 1.1 <= request["ratio_high"]
    text = matrix("compare", "vllm=0.29.0", "vllm=0.30.0").output
    assert "insufficient data (the 95 % interval" in text and "unchanged" not in text.split("pass rates")[0]


def test_enough_evidence_within_the_threshold_is_unchanged_and_go(matrix: Matrix) -> None:
    sync(matrix, GATES)
    runs(matrix, "vllm=0.29.0", 30, seed=1)
    runs(matrix, "vllm=0.30.0", 30, seed=2)
    code, data = _gate(matrix, "speed_strict")
    assert code == 0 and _insufficient(data) == {}, data
    compared = json.loads(matrix("compare", "vllm=0.29.0", "vllm=0.30.0", "--json").output)
    row = next(c for c in compared["cases"] if c["case"] == "vllm_agg_check")
    assert row["verdict"] == "unchanged", row
    assert {p["class"] for p in row["performance"] if p["better"]} == {"unchanged"}
