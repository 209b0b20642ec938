"""`matrix gate`: GO/NO-GO with every reason; waivers, regressions, not-run and flaky passes.

Outcomes are written straight into the database (see tests/helpers/reports.py); the seed-catalog test
needs no run at all.
"""

from __future__ import annotations

import datetime as dt
import json

from matrix.report.gate import evaluate_gate
from tests.helpers.cli import Matrix
from tests.helpers.gates import CASES, GATES, waivers
from tests.helpers.reports import attempt, campaign, db, runtime, sync


def all_pass(m: Matrix, spec: str, **overrides: str) -> None:
    with db(m) as s:
        camp = campaign(s)
        for case in CASES:
            attempt(s, camp, case, spec, overrides.get(case, "passed"))


def test_seed_gate_is_no_go_for_vllm_0_29_0_without_a_run(seeded: Matrix) -> None:
    result = seeded("gate", "vllm", "0.29.0")
    assert result.exit_code == 1, result.output
    assert result.output.startswith("NO-GO")
    assert "vllm#54814" in result.output
    assert "missing-fix" in result.output
    assert seeded.sql("SELECT count(*) FROM cell_run") == [(0,)]


def test_every_required_cell_passing_is_go(matrix: Matrix) -> None:
    sync(matrix, GATES)
    all_pass(matrix, "vllm=0.30.0")
    result = matrix("gate", "vllm", "0.30.0")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("GO")
    assert "required cells: 3 (3 passed); previous release: 0.29.0" in result.output


def test_cells_not_run_are_incomplete_with_every_reason(matrix: Matrix) -> None:
    """[M11] item 9: missing evidence is INCOMPLETE (exit 3), not NO-GO, and the skip reason is shown."""
    sync(matrix, GATES)
    with db(matrix) as s:
        camp = campaign(s)
        attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", "passed")
        attempt(s, camp, "vllm_long_prompt", "vllm=0.30.0", "skipped", message="needs 1 GPU, host has 0")
    result = matrix("gate", "vllm", "0.30.0", "--json")
    assert result.exit_code == 3
    data = json.loads(result.output)
    assert data["verdict"] == "INCOMPLETE" and data["exit_code"] == 3
    not_run = {r["case"]: r["message"] for r in data["reasons"] if r["kind"] == "not-run"}
    assert set(not_run) == {"vllm_long_prompt", "vllm_disaggregated"}
    assert "never run" in not_run["vllm_disaggregated"]
    assert "was skipped (campaign 1): needs 1 GPU, host has 0" in not_run["vllm_long_prompt"]
    text = matrix("gate", "vllm", "0.30.0")
    assert text.exit_code == 3 and text.output.startswith("INCOMPLETE")
    assert "needs 1 GPU, host has 0" in text.output
    markdown = matrix("gate", "vllm", "0.30.0", "--markdown")
    assert markdown.exit_code == 3 and "**INCOMPLETE**" in markdown.output


def test_a_failure_beside_missing_cells_is_no_go(matrix: Matrix) -> None:
    sync(matrix, GATES)
    with db(matrix) as s:
        attempt(s, campaign(s), "vllm_agg_check", "vllm=0.30.0", "failed", failure_kind="startup")
    result = matrix("gate", "vllm", "0.30.0")
    assert result.exit_code == 1 and result.output.startswith("NO-GO"), result.output


def test_a_later_skip_never_replaces_a_result(matrix: Matrix) -> None:
    """[M11] item 8: a pass and a failure (e.g. imported) stand after a local run skipped their cells."""
    sync(matrix, GATES)
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    with db(matrix) as s:
        camp = campaign(s)
        for case in CASES:
            attempt(s, camp, case, "vllm=0.30.0", "skipped", message="needs 1 GPU, host has 0")
    result = matrix("gate", "vllm", "0.30.0", "--json")
    assert result.exit_code == 1
    data = json.loads(result.output)
    reasons = {(r["kind"], r["case"]): r for r in data["reasons"]}
    assert reasons[("failed", "vllm_agg_check")]["blocking"]  # the failure did not vanish
    assert not any(kind == "not-run" for kind, _ in reasons)
    later = reasons[("skipped-later", "vllm_disaggregated")]
    assert not later["blocking"] and "needs 1 GPU, host has 0" in later["message"]
    assert "passed attempt of campaign 1" in later["message"]
    assert {c["case"]: c["status"] for c in data["cells"]}["vllm_disaggregated"] == "passed"
    # The grid keeps the pass and the failure, with the skip beside them.
    report = matrix.home / "report"
    assert matrix("report", "--out", str(report)).exit_code == 0
    index = (report / "index.html").read_text()
    assert index.count("then skip") >= 3 and "later skipped in campaign 2 (proves nothing)" in index
    assert matrix("export", "json").exit_code == 0


def test_a_lenient_go_says_so(matrix: Matrix) -> None:
    """[M11] item 9: GO above "required cells: 3 (2 passed)" names the excused failure on its first line."""
    sync(matrix, GATES, waivers(("vllm_agg_check", "", "2999-12-31")))
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    result = matrix("gate", "vllm", "0.30.0")
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("GO (lenient: only 2 of 3 required cells passed; 1 failure(s) excused by waivers)")


def test_nightly_case_is_not_required_by_the_release_policy(matrix: Matrix) -> None:
    sync(matrix, GATES)
    all_pass(matrix, "vllm=0.30.0")
    data = json.loads(matrix("gate", "vllm", "0.30.0", "--json").output)
    assert {c["case"] for c in data["cells"]} == set(CASES)


def test_failure_is_excused_by_a_valid_waiver_and_not_by_an_expired_one(matrix: Matrix) -> None:
    sync(matrix, GATES, waivers(("vllm_agg_check", "==0.30.0", "2999-12-31"), ("vllm_long_prompt", "", "2020-01-01")))
    with db(matrix) as s:
        camp = campaign(s)
        attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", "failed", failure_kind="validation",
                checks=[{"name": "worker_ids_distinct", "message": "same id"}])  # fmt: skip
        attempt(s, camp, "vllm_long_prompt", "vllm=0.30.0", "timeout", failure_kind="health")
        attempt(s, camp, "vllm_disaggregated", "vllm=0.30.0", "passed")
    result = matrix("gate", "vllm", "0.30.0", "--json")
    assert result.exit_code == 1
    reasons = {(r["kind"], r["case"]): r for r in json.loads(result.output)["reasons"]}
    waived = reasons[("waived", "vllm_agg_check")]
    assert (
        not waived["blocking"]
        and "until 2999-12-31" in waived["message"]
        and "worker_ids_distinct" in waived["message"]
    )
    assert reasons[("failed", "vllm_long_prompt")]["blocking"]
    expired = reasons[("waiver-expired", "vllm_long_prompt")]
    assert "2020-01-01" in expired["message"] and "excuses nothing" in expired["message"]
    assert ("failed", "vllm_agg_check") not in reasons


def test_waiver_that_does_not_admit_the_version_excuses_nothing(matrix: Matrix) -> None:
    sync(matrix, GATES, waivers(("vllm_agg_check", "<0.30", "2999-12-31")))
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    result = matrix("gate", "vllm", "0.30.0")
    assert result.exit_code == 1
    assert "failed" in result.output and "waived" not in result.output


def test_waiver_is_valid_through_its_expiry_day(matrix: Matrix) -> None:
    sync(matrix, GATES, waivers(("vllm_agg_check", "", "2030-06-30")))
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    with db(matrix) as s:
        on_the_day = evaluate_gate(s, "vllm", "0.30.0", today=dt.date(2030, 6, 30))
        day_after = evaluate_gate(s, "vllm", "0.30.0", today=dt.date(2030, 7, 1))
    assert on_the_day.go
    assert not day_after.go
    assert "waiver-expired" in {r.kind for r in day_after.reasons}


def test_regression_against_the_previous_final_release(matrix: Matrix) -> None:
    sync(matrix, GATES)
    all_pass(matrix, "vllm=0.29.0")  # the previous final release (0.29.1rc0 and the dev build are skipped)
    with db(matrix) as s:
        attempt(s, campaign(s), "vllm_agg_check", "vllm=0.29.1rc0", "failed")  # pre-release: not the baseline
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    data = json.loads(matrix("gate", "vllm", "0.30.0", "--json").output)
    assert data["previous_release"] == "0.29.0"
    regression = [r for r in data["reasons"] if r["kind"] == "regression"]
    assert len(regression) == 1 and regression[0]["case"] == "vllm_agg_check" and regression[0]["blocking"]
    assert "passed on the previous release 0.29.0" in regression[0]["message"]


def test_waived_regression_blocks_under_regressions_block_only(matrix: Matrix) -> None:
    sync(matrix, GATES, waivers(("vllm_agg_check", "", "2999-12-31")))
    all_pass(matrix, "vllm=0.29.0")
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    strict = matrix("gate", "vllm", "0.30.0", "--policy", "release")
    assert strict.exit_code == 1
    assert "even though waived" in strict.output
    lenient = matrix("gate", "vllm", "0.30.0", "--policy", "lenient", "--json")
    assert lenient.exit_code == 0, lenient.output
    kinds = {(r["kind"], r["blocking"]) for r in json.loads(lenient.output)["reasons"]}
    assert ("regression", False) in kinds and ("waived", False) in kinds


def test_flaky_pass_is_reported_and_blocks_only_when_the_policy_says_so(matrix: Matrix) -> None:
    sync(matrix, GATES)
    with db(matrix) as s:
        camp = campaign(s)
        attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", "failed", failure_kind="startup")
        attempt(s, camp, "vllm_agg_check", "vllm=0.30.0", "passed", attempt_no=2, flaky=True)
        attempt(s, camp, "vllm_long_prompt", "vllm=0.30.0", "passed")
        attempt(s, camp, "vllm_disaggregated", "vllm=0.30.0", "passed")
    release = matrix("gate", "vllm", "0.30.0")
    assert release.exit_code == 0, release.output
    assert "flaky" in release.output and "not blocking" in release.output
    strict = matrix("gate", "vllm", "0.30.0", "--policy", "strict")
    assert strict.exit_code == 1
    assert "blocks under flaky_blocks" in strict.output


def test_latest_attempt_across_campaigns_decides(matrix: Matrix) -> None:
    sync(matrix, GATES)
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    all_pass(matrix, "vllm=0.30.0")  # a later campaign fixed it
    assert matrix("gate", "vllm", "0.30.0").exit_code == 0


TRTLLM = """
[[runtime]]
backend = "trtllm"
version = "1.3.0rc26"
provider = { kind = "host" }

[[case]]
name = "trtllm_disaggregated"
backend = "trtllm"
arm = "dynamo"
model = "Qwen/Qwen3-0.6B"
markers = ["pre_merge", "trtllm", "e2e", "gpu_1"]
version_constraint = ">=1.3.0rc27"
"""


def test_policy_selecting_nothing_is_not_applicable(matrix: Matrix) -> None:
    sync(matrix, GATES, TRTLLM)
    result = matrix("gate", "trtllm", "1.3.0rc26")
    assert result.exit_code == 4, result.output
    assert result.output.startswith("N/A: ") and "NO-GO" not in result.output
    assert "selects no case" in result.output
    assert "outside the case's constraint >=1.3.0rc27" in result.output


def test_bad_input_exits_2_and_names_the_fix(matrix: Matrix) -> None:
    sync(matrix, GATES)
    cases = {
        ("gate", "vllm", "9.9.9"): "known versions: 0.28.0",
        ("gate", "nosuch", "1.0"): "unknown backend 'nosuch'",
        ("gate", "vllm", "0.30.0", "--policy", "nope"): "unknown gate policy 'nope'",
        ("gate", "vllm", "0.30.0", "--policy", "typo"): "unknown rule(s) flaky_block",
        ("gate", "vllm", "not-a-version"): "not a PEP 440 version",
    }
    for args, message in cases.items():
        result = matrix(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)


def test_markdown_and_html_outputs(matrix: Matrix) -> None:
    sync(matrix, GATES, waivers(("vllm_agg_check", "", "2999-12-31")))
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    page = matrix.home / "gate.html"
    result = matrix("gate", "vllm", "0.30.0", "--markdown", "--html", str(page))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("## Release gate: **GO** (lenient: only 2 of 3 required cells passed")
    assert "<b>" not in result.output and "&lt;b&gt;" in result.output  # the waiver reason stays text
    html = page.read_text()
    assert "GO" in html and "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html
    assert "lenient: only 2 of 3 required cells passed" in html


VARIANTS = """
[[runtime]]
backend = "vllm"
version = "0.29.0+vllm.rs.0.30.0"
provider = { kind = "host" }
components = { vllm = "0.29.0", vllm-rs = "0.30.0" }
notes = "written by hand: Python vLLM 0.29.0 with the vllm-rs of 0.30.0"

[[runtime]]
backend = "vllm"
version = "0.29.0+container"
provider = { kind = "host" }
components = { vllm = "0.29.0", vllm-rs = "0.29.0" }
"""


def test_a_variant_is_not_the_previous_release(matrix: Matrix) -> None:
    """PEP 440 sorts 0.29.0+vllm.rs.0.30.0 (and 0.29.0+container) between 0.29.0 and 0.30.0, but neither was
    released: the regression baseline of 0.30.0 is 0.29.0, whose pass of vllm_agg_check makes 0.30.0's
    failure a regression even though the variants failed it too."""
    sync(matrix, GATES, VARIANTS)
    all_pass(matrix, "vllm=0.29.0")
    all_pass(matrix, "vllm=0.29.0+vllm.rs.0.30.0", vllm_agg_check="failed")
    all_pass(matrix, "vllm=0.29.0+container", vllm_agg_check="failed")
    all_pass(matrix, "vllm=0.30.0", vllm_agg_check="failed")
    data = json.loads(matrix("gate", "vllm", "0.30.0", "--json").output)
    assert data["previous_release"] == "0.29.0"
    assert [r["case"] for r in data["reasons"] if r["kind"] == "regression"] == ["vllm_agg_check"]
    # A variant's own gate compares it with the release it was made from.
    variant = json.loads(matrix("gate", "vllm", "0.29.0+vllm.rs.0.30.0", "--json").output)
    assert variant["previous_release"] == "0.29.0"


def test_a_derived_runtime_is_not_a_release_and_a_lone_local_label_is(matrix: Matrix) -> None:
    """A runtime stored by `runtime derive`/`run --with` (source "derived") is skipped whatever its version;
    a local-labelled version whose public version is no runtime (a build published that way, e.g.
    0.29.5+cpu) is a release like any other."""
    lone = '[[runtime]]\nbackend = "vllm"\nversion = "0.29.5+cpu"\nprovider = { kind = "host" }\n'
    derived = '[[runtime]]\nbackend = "vllm"\nversion = "0.29.7"\nprovider = { kind = "host" }\n'
    sync(matrix, GATES, lone, derived)
    with db(matrix) as s:
        runtime(s, "vllm=0.29.7").source = "derived"
    assert json.loads(matrix("gate", "vllm", "0.30.0", "--json").output)["previous_release"] == "0.29.5+cpu"
