"""[M29] item 7: a failure of `loopback_only` alone is `exposed`; with another failed check it stays what that
check makes it (exposure never hides a wrong answer)."""

from __future__ import annotations

import json

from matrix.skew_outcome import classify
from tests.helpers.cli import Matrix
from tests.helpers.gates import CASES, GATES, waivers
from tests.helpers.reports import attempt, campaign, db, sync

WHERE = "listens beyond loopback: prefill 0.0.0.0:41234/tcp"
LOOPBACK = {"name": "loopback_only", "kind": "validation", "message": WHERE}
CONTENT = {"name": "content", "kind": "validation", "message": "expected 'Paris', got 'Lyon'"}


def test_only_loopback_only_failed_is_exposed() -> None:
    verdict = classify("failed", "validation", f"failed checks: loopback_only; {WHERE}", [LOOPBACK], {})
    assert verdict.cls == "exposed" and "0.0.0.0:41234" in verdict.reason


def test_a_wrong_answer_that_is_also_exposed_stays_healthy_but_wrong() -> None:
    verdict = classify("failed", "validation", "failed checks: content, loopback_only", [CONTENT, LOOPBACK], {})
    assert verdict.cls == "healthy-but-wrong"


def test_the_gate_reports_exposure_and_a_waiver_excuses_it(matrix: Matrix) -> None:
    sync(matrix, GATES, waivers(("vllm_long_prompt", "", "2999-12-31")))
    with db(matrix) as s:
        for spec in ("vllm=0.29.0", "vllm=0.30.0"):
            camp = campaign(s)
            for case in CASES:
                exposed = spec == "vllm=0.30.0" and case in ("vllm_agg_check", "vllm_long_prompt")
                fields = {"failure_kind": "validation", "checks": [LOOPBACK]} if exposed else {}
                attempt(s, camp, case, spec, "failed" if exposed else "passed", **fields)
    data = json.loads(matrix("gate", "vllm", "0.30.0", "--json").output)
    reasons = {(r["kind"], r["case"]): r for r in data["reasons"]}
    assert reasons[("exposure", "vllm_agg_check")]["blocking"]
    assert "not a regression" in reasons[("exposure", "vllm_agg_check")]["message"]
    assert not reasons[("waived", "vllm_long_prompt")]["blocking"]
    assert not any(kind == "regression" for kind, _ in reasons), reasons
    assert data["verdict"] == "NO-GO"
