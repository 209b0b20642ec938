"""[M29] item 8: `NO-GO (predicted)` only where no required cell ran and failed.

A runtime that lacks a fix a required case needs is NO-GO before anything runs (predicted from the catalog).
Once that cell ran and failed, the NO-GO is measured, even when a waiver excuses the failure (waivers never
excuse a missing fix): it must not say "predicted" nor "no required cell has failed".
"""

from __future__ import annotations

import json

from tests.helpers.cli import Matrix
from tests.helpers.gates import CASES, GATES, waivers
from tests.helpers.reports import attempt, campaign, db, sync

WAIVED = waivers(("vllm_disaggregated", "", "2999-12-31"))


def test_a_missing_fix_before_any_run_is_predicted(matrix: Matrix) -> None:
    sync(matrix, GATES, WAIVED)
    result = matrix("gate", "vllm", "0.29.0", "--json")
    data = json.loads(result.output)
    assert result.exit_code == 1 and data["verdict"] == "NO-GO" and data["predicted"], data
    assert matrix("gate", "vllm", "0.29.0").output.startswith("NO-GO (predicted)")


def test_a_waived_failure_of_a_cell_that_ran_is_measured_not_predicted(matrix: Matrix) -> None:
    sync(matrix, GATES, WAIVED)
    with db(matrix) as s:
        camp = campaign(s)
        for case in CASES:
            status = "failed" if case == "vllm_disaggregated" else "passed"
            attempt(s, camp, case, "vllm=0.29.0", status, failure_kind="validation" if status == "failed" else None)
    result = matrix("gate", "vllm", "0.29.0", "--json")
    data = json.loads(result.output)
    assert result.exit_code == 1 and data["verdict"] == "NO-GO", data
    kinds = {(r["kind"], r["blocking"]) for r in data["reasons"]}
    assert ("waived", False) in kinds and ("missing-fix", True) in kinds, kinds
    assert data["predicted"] is False
    text = matrix("gate", "vllm", "0.29.0").output
    first, explanation = text.splitlines()[:2]
    assert first.startswith("NO-GO:") and "(predicted)" not in text, text
    assert "vllm_disaggregated ran and failed" in explanation and "no required cell has failed" not in text
    markdown = matrix("gate", "vllm", "0.29.0", "--markdown").output
    assert "(predicted)" not in markdown and "predicted, not measured" not in markdown
