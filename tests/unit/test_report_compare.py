"""`matrix compare`: runtime against runtime, component version against component version."""

from __future__ import annotations

import json

import pytest

from matrix.report.compare import verdict
from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("passed", "passed", "unchanged"),
        ("failed", "passed", "fixed"),
        ("passed", "timeout", "regressed"),
        ("error", "failed", "still failing"),
        (None, "passed", "new"),
        ("skipped", "failed", "new"),
        ("passed", None, "missing"),
        ("passed", "not-run", "missing"),
        # The engine refused a dependency of matrix's recipe: the recipe's fault, never a regression.
        ("passed", "failed/recipe", "recipe fault"),
        ("failed", "failed/recipe", "recipe fault"),
        ("passed", "failed/startup", "regressed"),
    ],
)
def test_verdicts(a: str | None, b: str | None, expected: str) -> None:
    class _Outcome:
        def __init__(self, status: str) -> None:
            self.status, _, kind = status.partition("/")
            self.failure_kind = kind or None

    oa = _Outcome(a) if a else None
    ob = _Outcome(b) if b else None
    assert verdict(oa, ob) == expected  # type: ignore[arg-type]


@pytest.fixture
def history(matrix: Matrix) -> Matrix:
    sync(matrix)
    with db(matrix) as s:
        old = campaign(s)
        attempt(s, old, "vllm_agg_check", "vllm=0.29.0", "passed", ready_s=2.0, request_s=1.0, total_s=4.0)
        attempt(s, old, "vllm_long_prompt", "vllm=0.29.0", "failed", failure_kind="validation")
        attempt(s, old, "vllm_disaggregated", "vllm=0.29.0", "failed")
        attempt(s, old, "vllm_nightly_only", "vllm=0.29.0", "passed")
        new = campaign(s)
        attempt(s, new, "vllm_agg_check", "vllm=0.30.0", "failed", ready_s=3.0, request_s=0.5, total_s=4.0)
        attempt(s, new, "vllm_long_prompt", "vllm=0.30.0", "passed")
        attempt(s, new, "vllm_disaggregated", "vllm=0.30.0", "failed")
        # The dev runtime bundles Python vLLM 0.29.0 too: for `--component vllm 0.29.0` it joins the A side,
        # and its newer attempt wins for that case.
        attempt(s, new, "vllm_disaggregated", "vllm=0.29.1rc1.dev347+gdee37d891", "passed")
    return matrix


def test_compare_two_runtimes(history: Matrix) -> None:
    result = history("compare", "vllm=0.29.0", "vllm=0.30.0", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    verdicts = {c["case"]: c["verdict"] for c in data["cases"]}
    assert verdicts == {
        "vllm_agg_check": "regressed",
        "vllm_long_prompt": "fixed",
        "vllm_disaggregated": "still failing",
        "vllm_nightly_only": "missing",
    }
    ratios = next(c["ratios"] for c in data["cases"] if c["case"] == "vllm_agg_check")
    # Ratios are the statistics' ratios of medians over passed attempts: a failure's timings describe the
    # failure, so a case that passed on one side only has none (one number per metric, never two).
    assert ratios == {}
    assert data["counts"] == {"regressed": 1, "fixed": 1, "still failing": 1, "missing": 1}


def test_compare_table_lists_regressions_first(history: Matrix) -> None:
    result = history("compare", "vllm=0.29.0", "vllm=0.30.0")
    assert result.exit_code == 0
    lines = [line for line in result.output.splitlines() if "vllm_" in line]
    assert "regressed" in lines[0]  # no ratio: a failure's timings are not a sample
    assert "1 regressed, 1 fixed, 1 still failing, 1 missing" in result.output


def test_compare_component_versions_across_runtimes(history: Matrix) -> None:
    result = history("compare", "--component", "vllm", "0.29.0", "0.30.0", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["a"]["runtimes"] == ["vllm=0.29.0", "vllm=0.29.1rc1.dev347+gdee37d891"]
    cases = {c["case"]: c for c in data["cases"]}
    assert cases["vllm_disaggregated"]["a"]["runtime"] == "vllm=0.29.1rc1.dev347+gdee37d891"
    assert cases["vllm_disaggregated"]["verdict"] == "regressed"


def test_compare_writes_a_page(history: Matrix) -> None:
    page = history.home / "out" / "cmp.html"
    assert history("compare", "vllm=0.29.0", "vllm=0.30.0", "--html", str(page)).exit_code == 0
    html = page.read_text()
    assert "vllm=0.29.0" in html and "regressed" in html


def test_compare_bad_input_exits_2(history: Matrix) -> None:
    for args, message in {
        ("compare", "vllm=0.29.0", "vllm"): "write BACKEND=VERSION",
        ("compare", "vllm=0.29.0", "vllm=1.0"): "unknown runtime vllm=1.0",
        ("compare", "--component", "vllm-rs", "0.29.0", "9.9"): "known versions of vllm-rs: 0.28.0",
        ("compare", "--component", "nope", "1", "2"): "no runtime lists a component 'nope'",
    }.items():
        result = history(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)


def test_compare_stands_on_the_newest_skip(matrix: Matrix) -> None:
    # Only skips on side A: the case's standing attempt (`outcome.standing_attempt`) is the newest one, as in
    # every other report, not the oldest.
    sync(matrix)
    with db(matrix) as s:
        camp = campaign(s)
        attempt(s, camp, "vllm_long_prompt", "vllm=0.29.0", "skipped")
        attempt(s, camp, "vllm_long_prompt", "vllm=0.29.1rc1.dev347+gdee37d891", "skipped")
        attempt(s, camp, "vllm_long_prompt", "vllm=0.30.0", "passed")
    result = matrix("compare", "--component", "vllm", "0.29.0", "0.30.0", "--json")
    assert result.exit_code == 0, result.output
    case = next(c for c in json.loads(result.output)["cases"] if c["case"] == "vllm_long_prompt")
    assert case["a"]["runtime"] == "vllm=0.29.1rc1.dev347+gdee37d891"
    assert case["verdict"] == "new"
