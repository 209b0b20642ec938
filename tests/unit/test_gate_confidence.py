"""[M15] item 2 and 3 in the gate: `min_pass_rate` (Wilson lower bound) with `min_samples`, and
`max_slowdown` (significant and past the threshold), on attempts written straight into the database."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync

CASES = ("vllm_agg_check", "vllm_long_prompt", "vllm_disaggregated")

GATES = """
[[gate]]
name = "flake"
expression = "(pre_merge or post_merge) and e2e"
rules = { min_pass_rate = 0.95, min_samples = 10 }

[[gate]]
name = "speed"
expression = "(pre_merge or post_merge) and e2e"
rules = { max_slowdown = 0.10, perf_alpha = 0.01 }

[[gate]]
name = "bad_rate"
expression = "e2e"
rules = { min_pass_rate = 1.5 }

[[gate]]
name = "bad_samples"
expression = "e2e"
rules = { min_pass_rate = 0.9, min_samples = 2.5 }
"""


def runs(m: Matrix, spec: str, outcomes: dict[str, str], scale: float = 1.0, seed: int = 0) -> None:
    """One attempt per letter ("P" passed, "F" failed) of each case, request times around `scale`."""
    rng = random.Random(seed)
    with db(m) as s:
        camp = campaign(s)
        for case in CASES:
            for number, letter in enumerate(outcomes.get(case, "P"), start=1):
                status = "passed" if letter == "P" else "failed"
                request = scale * 0.1 * math.exp(rng.gauss(0, 0.05))
                attempt(s, camp, case, spec, status, attempt_no=number, request_s=request, ttft_s=request / 2,
                        completion_tokens=16)  # fmt: skip


def test_few_samples_are_incomplete_evidence(matrix: Matrix) -> None:
    sync(matrix, GATES)
    runs(matrix, "vllm=0.30.0", {case: "PFP" for case in CASES})
    result = matrix("gate", "vllm", "0.30.0", "--policy", "flake")
    assert result.exit_code == 3, result.output
    assert result.output.startswith("INCOMPLETE") and "few-samples" in result.output
    assert "2/3 passed" in result.output and "fewer than min_samples = 10" in result.output


def test_a_30_percent_flake_is_no_go_and_shows_its_interval(matrix: Matrix) -> None:
    sync(matrix, GATES)
    flaky = "PPFPPPFPPF" * 3  # 21 of 30
    runs(matrix, "vllm=0.30.0", {"vllm_agg_check": flaky, "vllm_long_prompt": "P" * 80, "vllm_disaggregated": "P" * 80})
    result = matrix("gate", "vllm", "0.30.0", "--policy", "flake", "--json")
    data = json.loads(result.output)
    assert result.exit_code == 1 and data["verdict"] == "NO-GO"
    (low,) = [r for r in data["reasons"] if r["kind"] == "low-pass-rate"]
    assert low["case"] == "vllm_agg_check" and "21/30 passed (70 %, 95 % CI 52-83 %)" in low["message"]
    assert "history PPFPPPFPPF" in low["message"]
    cell = next(c for c in data["cells"] if c["case"] == "vllm_agg_check")
    assert cell["pass_rate"]["flaky"] and round(cell["pass_rate"]["wilson_low"], 3) == 0.521
    assert data["policy"]["min_pass_rate"] == 0.95 and data["policy"]["min_samples"] == 10


def test_all_passing_but_too_few_for_the_bound_is_inconclusive_then_go(matrix: Matrix) -> None:
    """30 of 30 show only > 0.886: not yet 0.95 (inconclusive, INCOMPLETE); 80 of 80 show > 0.954 (GO)."""
    sync(matrix, GATES)
    runs(matrix, "vllm=0.30.0", {case: "P" * 30 for case in CASES})
    result = matrix("gate", "vllm", "0.30.0", "--policy", "flake")
    assert result.exit_code == 3 and "inconclusive" in result.output, result.output
    runs(matrix, "vllm=0.30.0", {case: "P" * 50 for case in CASES})
    result = matrix("gate", "vllm", "0.30.0", "--policy", "flake")
    assert result.exit_code == 0, result.output


def test_a_significant_slowdown_against_the_previous_release_blocks(matrix: Matrix) -> None:
    sync(matrix, GATES)
    runs(matrix, "vllm=0.29.0", {case: "P" * 30 for case in CASES}, seed=1)
    runs(matrix, "vllm=0.30.0", {case: "P" * 30 for case in CASES}, scale=1.2, seed=2)
    result = matrix("gate", "vllm", "0.30.0", "--policy", "speed")
    assert result.exit_code == 1, result.output
    assert "slowdown" in result.output and "request_s x1." in result.output and "against 0.29.0" in result.output


def test_an_unchanged_release_passes_the_speed_gate(matrix: Matrix) -> None:
    sync(matrix, GATES)
    runs(matrix, "vllm=0.29.0", {case: "P" * 30 for case in CASES}, seed=1)
    runs(matrix, "vllm=0.30.0", {case: "P" * 30 for case in CASES}, seed=2)
    result = matrix("gate", "vllm", "0.30.0", "--policy", "speed")
    assert result.exit_code == 0, result.output


def test_bad_numeric_rules_are_exit_2_naming_the_rule(matrix: Matrix) -> None:
    sync(matrix, GATES)
    before = matrix.dump()
    result = matrix("gate", "vllm", "0.30.0", "--policy", "bad_rate")
    assert result.exit_code == 2 and "rule min_pass_rate must be a pass rate from 0 to 1" in result.output
    result = matrix("gate", "vllm", "0.30.0", "--policy", "bad_samples")
    assert result.exit_code == 2 and "rule min_samples must be a whole number" in result.output
    assert matrix.dump() == before


def test_repeat_with_retries_is_refused_before_anything_is_written(matrix: Matrix) -> None:
    sync(matrix)
    before = matrix.dump()
    result = matrix("run", "--repeat", "3", "--max-attempts", "2", "--backend", "reference", "--no-report")
    assert result.exit_code == 2 and "--repeat" in result.output and "--max-attempts" in result.output
    result = matrix("run", "--repeat", "0", "--backend", "reference", "--no-report")
    assert result.exit_code == 2 and "--repeat must be at least 1" in result.output
    assert matrix.dump() == before


def test_repeat_plans_one_pending_row_per_repeat(matrix: Matrix) -> None:
    """The campaign's rows before any cell starts: attempts 1..N pending (claimed like any attempt)."""
    from matrix.campaign import RunOptions, _selected_cells
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.plan import Selection

    sync(matrix)
    engine = create_db_engine(f"sqlite:///{matrix.db_path}")
    try:
        with transaction(session_factory(engine)) as session:
            options = RunOptions(Selection(backends=("reference",), cases=("reference_disaggregated",)), repeat=4)
            campaign_id, chosen = _selected_cells(session, options, lambda _: None)
    finally:
        engine.dispose()
    assert [attempt for _, attempt, _ in chosen] == [1, 2, 3, 4]
    rows = matrix.sql(f"SELECT attempt, status FROM cell_run WHERE campaign_id = {campaign_id} ORDER BY attempt")
    assert rows == [(1, "pending"), (2, "pending"), (3, "pending"), (4, "pending")]


def test_repeats_take_turns_across_cells(matrix: Matrix) -> None:
    """Every cell's first repeat, then every second one: compared runtimes share the host's load over time."""
    from matrix.campaign import RunOptions, _selected_cells
    from matrix.db.engine import create_db_engine, session_factory, transaction
    from matrix.plan import Selection

    sync(matrix)
    engine = create_db_engine(f"sqlite:///{matrix.db_path}")
    try:
        with transaction(session_factory(engine)) as session:
            # One case on every vllm runtime of the test catalog: several cells.
            options = RunOptions(Selection(cases=("vllm_agg_check",)), repeat=3)
            _, chosen = _selected_cells(session, options, lambda _: None)
            order = [(cell.key, attempt) for cell, attempt, _ in chosen]
    finally:
        engine.dispose()
    cells = len({key for key, _ in order})
    assert cells >= 2 and len(order) == 3 * cells
    assert [attempt for _, attempt in order] == [1] * cells + [2] * cells + [3] * cells
    assert [key for key, _ in order[:cells]] == [key for key, _ in order[cells : 2 * cells]]


def test_without_scipy_the_speed_rule_is_untested_not_a_silent_go(
    matrix: Matrix, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[M21] item 15: the rule cannot be judged, so the verdict is INCOMPLETE and names the extra."""
    sync(matrix, GATES)
    runs(matrix, "vllm=0.29.0", {case: "P" * 5 for case in CASES}, seed=1)
    runs(matrix, "vllm=0.30.0", {case: "P" * 5 for case in CASES}, scale=1.2, seed=2)
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    result = matrix("gate", "vllm", "0.30.0", "--policy", "speed")
    assert result.exit_code == 3, result.output
    assert "slowdown-untested" in result.output and "disagg-matrix[stats]" in result.output
