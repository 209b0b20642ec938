"""[M29] item 5: an interrupted attempt says nothing about the runtime, so it never replaces the evidence.

A runner killed or SIGTERMed mid-cell leaves an `interrupted` attempt after the finished ones. Every verdict
(compare, `--fail-on`, gate, the report's grid) stands on the newest attempt that finished on its own, as it
already did for a later skip.
"""

from __future__ import annotations

import json

from tests.helpers.cli import Matrix
from tests.helpers.gates import CASES, GATES
from tests.helpers.reports import attempt, campaign, db, sync

INTERRUPTED = {"failure_kind": "infra", "message": "interrupted: stop requested (SIGTERM)"}


def _timed(m: Matrix, spec: str, request_s: list[float], *, then_interrupted: bool) -> None:
    """Passed attempts of vllm_agg_check with these request times, then (optionally) an interrupted one."""
    with db(m) as s:
        camp = campaign(s)
        for n, seconds in enumerate(request_s, start=1):
            attempt(s, camp, "vllm_agg_check", spec, "passed", attempt_no=n, request_s=seconds)
        if then_interrupted:
            attempt(s, campaign(s), "vllm_agg_check", spec, "interrupted", request_s=None, ready_s=None,
                    total_s=None, **INTERRUPTED)  # fmt: skip


def _case(result_output: str) -> dict[str, object]:
    cases = json.loads(result_output)["cases"]
    return next(c for c in cases if c["case"] == "vllm_agg_check")  # type: ignore[no-any-return]


SLOW = [1.50, 1.52, 1.49, 1.55, 1.51, 1.53, 1.48, 1.54]
FAST = [1.00, 1.02, 0.99, 1.03, 1.01, 1.00, 0.98, 1.02]


def test_an_interrupted_baseline_does_not_turn_a_slowdown_into_fixed(matrix: Matrix) -> None:
    sync(matrix)
    _timed(matrix, "vllm=0.29.0", FAST, then_interrupted=True)
    _timed(matrix, "vllm=0.30.0", SLOW, then_interrupted=False)
    result = matrix("compare", "vllm=0.29.0", "vllm=0.30.0", "--json", "--fail-on", "regression")
    case = _case(result.output)
    assert case["verdict"] == "slower", case
    assert case["a"]["status"] == "passed"  # type: ignore[index]
    assert result.exit_code == 1  # the slowdown fails CI; the interruption did not hide it
    text = matrix("compare", "vllm=0.29.0", "vllm=0.30.0", "--fail-on", "regression")
    assert text.exit_code == 1 and "vllm_agg_check (slower)" in text.output, text.output


def test_an_interrupted_candidate_is_not_a_regression(matrix: Matrix) -> None:
    sync(matrix)
    _timed(matrix, "vllm=0.29.0", FAST, then_interrupted=False)
    _timed(matrix, "vllm=0.30.0", FAST, then_interrupted=True)
    result = matrix("compare", "vllm=0.29.0", "vllm=0.30.0", "--json", "--fail-on", "regression")
    assert result.exit_code == 0, result.output
    case = _case(result.output)
    assert case["verdict"] == "unchanged" and case["b"]["status"] == "passed", case  # type: ignore[index]


def test_only_interrupted_attempts_are_missing_evidence_not_a_failure(matrix: Matrix) -> None:
    sync(matrix)
    _timed(matrix, "vllm=0.29.0", FAST[:2], then_interrupted=False)
    _timed(matrix, "vllm=0.30.0", [], then_interrupted=True)
    result = matrix("compare", "vllm=0.29.0", "vllm=0.30.0", "--json", "--fail-on", "failure")
    assert result.exit_code == 0, result.output
    assert _case(result.output)["verdict"] == "missing"


def test_the_gate_stands_on_eleven_passes_not_on_the_interrupted_twelfth(matrix: Matrix) -> None:
    sync(matrix, GATES)
    with db(matrix) as s:
        camp = campaign(s)
        for case in CASES:
            for n in range(1, 12):
                attempt(s, camp, case, "vllm=0.30.0", "passed", attempt_no=n)
        killed = campaign(s)
        attempt(s, killed, "vllm_agg_check", "vllm=0.30.0", "interrupted", **INTERRUPTED)
    result = matrix("gate", "vllm", "0.30.0", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["verdict"] == "GO" and data["passed"] == 3
    later = [r for r in data["reasons"] if r["kind"] == "skipped-later"]
    assert len(later) == 1 and not later[0]["blocking"] and "was interrupted (campaign 2)" in later[0]["message"]
    # The grid keeps the pass, with the interruption beside it.
    report = matrix.home / "report"
    assert matrix("report", "--out", str(report)).exit_code == 0
    index = (report / "index.html").read_text()
    assert "then interrupted" in index and "later interrupted in campaign 2 (proves nothing)" in index


def test_a_gate_with_only_an_interrupted_attempt_is_incomplete(matrix: Matrix) -> None:
    sync(matrix, GATES)
    all_but_one = [c for c in CASES if c != "vllm_agg_check"]
    with db(matrix) as s:
        camp = campaign(s)
        for case in all_but_one:
            attempt(s, camp, case, "vllm=0.30.0", "passed")
        attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", "interrupted", **INTERRUPTED)
    result = matrix("gate", "vllm", "0.30.0", "--json")
    assert result.exit_code == 3, result.output
    data = json.loads(result.output)
    not_run = [r for r in data["reasons"] if r["kind"] == "not-run"]
    assert [r["case"] for r in not_run] == ["vllm_agg_check"] and "was interrupted" in not_run[0]["message"]


def test_an_interrupted_skew_attempt_does_not_replace_the_pair_that_worked(matrix: Matrix) -> None:
    from matrix.cells import roles_key
    from tests.helpers.gates import SKEW_GATES, diagonal_passes

    sync(matrix, SKEW_GATES)
    diagonal_passes(matrix)
    for prefill, decode in (("0.30.0", "0.29.0"), ("0.29.0", "0.30.0")):
        roles = {"prefill": prefill, "decode": decode}
        with db(matrix) as s:
            attempt(s, campaign(s), "vllm_disaggregated", f"vllm={decode}", "passed", roles=roles,
                    roles_key=roles_key(roles))  # fmt: skip
            attempt(s, campaign(s), "vllm_disaggregated", f"vllm={decode}", "interrupted", roles=roles,
                    roles_key=roles_key(roles), **INTERRUPTED)  # fmt: skip
    grid = json.loads(matrix("skew", "vllm_disaggregated", "--json").output)["cells"]
    assert {c["class"] for c in grid} == {"works"}, grid
    result = matrix("gate", "vllm", "0.30.0", "--policy", "upgrade", "--json")
    assert result.exit_code == 0, result.output
