"""[M29] item 6: without a significance test (no scipy) `compare` says `slower (not tested)` or
`insufficient data`, never `unchanged`, and `--fail-on regression` fails on an untested slowdown."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync

FAST = [1.00, 1.02, 0.99, 1.03, 1.01, 1.00]
SLOW = [1.48, 1.50, 1.47, 1.52, 1.49, 1.51]  # +48 %, the interval wholly above 10 %


def _passes(m: Matrix, spec: str, request_s: list[float]) -> None:
    with db(m) as s:
        camp = campaign(s)
        for n, seconds in enumerate(request_s, start=1):
            attempt(s, camp, "vllm_agg_check", spec, "passed", attempt_no=n, request_s=seconds, ready_s=2.0)


@pytest.fixture
def without_scipy(monkeypatch: pytest.MonkeyPatch) -> None:
    """scipy unimportable, as on a base install (`significance_available` imports it on every call)."""
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)


def _verdict(m: Matrix, *args: str) -> tuple[int, dict[str, object]]:
    result = m("compare", "vllm=0.29.0", "vllm=0.30.0", "--json", *args)
    data = json.loads(result.output)
    return result.exit_code, next(c for c in data["cases"] if c["case"] == "vllm_agg_check")


@pytest.mark.usefixtures("without_scipy")
def test_a_significant_slowdown_without_scipy_is_slower_not_tested(matrix: Matrix) -> None:
    sync(matrix)
    _passes(matrix, "vllm=0.29.0", FAST)
    _passes(matrix, "vllm=0.30.0", SLOW)
    code, case = _verdict(matrix, "--fail-on", "regression")
    assert case["verdict"] == "slower (not tested)" and code == 1, case
    text = matrix("compare", "vllm=0.29.0", "vllm=0.30.0", "--fail-on", "regression")
    assert text.exit_code == 1 and "vllm_agg_check (slower (not tested))" in text.output


@pytest.mark.usefixtures("without_scipy")
def test_no_slowdown_without_scipy_is_insufficient_data_not_unchanged(matrix: Matrix) -> None:
    sync(matrix)
    _passes(matrix, "vllm=0.29.0", FAST)
    _passes(matrix, "vllm=0.30.0", FAST)
    code, case = _verdict(matrix, "--fail-on", "regression")
    assert case["verdict"] == "insufficient data" and code == 0, case


def test_with_scipy_the_same_samples_are_slower(matrix: Matrix) -> None:
    sync(matrix)
    _passes(matrix, "vllm=0.29.0", FAST)
    _passes(matrix, "vllm=0.30.0", SLOW)
    code, case = _verdict(matrix, "--fail-on", "regression")
    assert case["verdict"] == "slower" and code == 1, case
