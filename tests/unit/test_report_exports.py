"""`matrix export junit|markdown|json` on attempts written into the database."""

from __future__ import annotations

import json
from pathlib import Path

from lxml import etree

from tests.helpers.cli import REPO, Matrix
from tests.helpers.reports import attempt, campaign, db, sync

SCHEMA = REPO / "tests" / "schemas" / "junit-10.xsd"
HOSTILE = "<script>alert(1)</script> \x1b[1mbold\x1b[0m \x00\x07 ]]> & HF_TOKEN=hunter2 @team | [x](javascript:a)"


def validate_junit(data: bytes) -> etree._Element:
    """Parse and validate against the xunit2 schema; return the root."""
    schema = etree.XMLSchema(etree.parse(str(SCHEMA)))
    root = etree.fromstring(data)
    schema.assertValid(root)
    return root


def populate(m: Matrix, log_dir: Path) -> None:
    sync(m)
    with db(m) as s:
        c1 = campaign(s)
        attempt(s, c1, "vllm_agg_check", "vllm=0.29.0", "failed", failure_kind="validation", message=HOSTILE,
                checks=[{"name": "worker_ids_distinct", "message": "both 7"},
                        {"name": "content_nonblank", "message": HOSTILE}], log_dir=str(log_dir))  # fmt: skip
        attempt(s, c1, "vllm_long_prompt", "vllm=0.29.0", "failed", failure_kind="startup", message="crashed")
        attempt(s, c1, "vllm_long_prompt", "vllm=0.29.0", "passed", attempt_no=2, flaky=True,
                completion_excerpt=HOSTILE)  # fmt: skip
        attempt(s, c1, "vllm_disaggregated", "vllm=0.29.0", "timeout", failure_kind="health",
                expected_failure="lacks vllm#54814")  # fmt: skip
        attempt(s, c1, "vllm_nightly_only", "vllm=0.29.0", "skipped", message="needs 1 GPU, host has 0")
        c2 = campaign(s)
        attempt(s, c2, "reference_disaggregated", "reference=0.1.0", "passed", prefill_worker_id="15783270017955876104")
        attempt(s, c2, "vllm_agg_check", "vllm=0.30.0", "not-run", message="not started: fail-fast")


def test_junit_validates_and_carries_every_check(matrix: Matrix, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "decode.log").write_text("ok\n" * 5000 + HOSTILE + "\n")
    populate(matrix, logs)
    out = tmp_path / "junit.xml"
    result = matrix("export", "junit", "--out", str(out))
    assert result.exit_code == 0, result.output
    root = validate_junit(out.read_bytes())
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    suite = suites["vllm-0.29.0"]
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["backend"] == "vllm" and props["version"] == "0.29.0" and props["component:vllm-rs"] == "0.29.0"
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    failure = cases["vllm_agg_check"].find("failure")
    assert failure is not None and failure.get("type") == "failed:validation"
    assert "worker_ids_distinct" in failure.get("message", "") and "content_nonblank" in failure.get("message", "")
    assert "worker_ids_distinct: both 7" in (failure.text or "")
    out_text = cases["vllm_agg_check"].findtext("system-out") or ""
    assert "decode.log: last" in out_text and "<script>" in out_text  # text, escaped by the XML serialiser
    assert "hunter2" not in out.read_text() and "\x1b" not in out.read_text()
    assert cases["vllm_disaggregated"].find("failure").get("type") == "timeout:health"  # type: ignore[union-attr]
    assert "expected to fail: lacks vllm#54814" in (cases["vllm_disaggregated"].findtext("failure") or "")
    assert cases["vllm_nightly_only"].find("skipped").get("message") == "needs 1 GPU, host has 0"  # type: ignore[union-attr]
    flaky = cases["vllm_long_prompt"].find("flakyFailure")
    assert flaky is not None and flaky.get("type") == "startup"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "2", "1")
    newer = {c.get("name"): c for c in suites["vllm-0.30.0"].iter("testcase")}
    assert newer["vllm_new_only"].find("skipped").get("type") == "no-result"  # type: ignore[union-attr]
    assert newer["vllm_agg_check"].find("skipped").get("type") == "not-run"  # type: ignore[union-attr]
    assert out.read_bytes().startswith(b"<?xml")


def test_junit_for_one_campaign(matrix: Matrix, tmp_path: Path) -> None:
    populate(matrix, tmp_path)
    result = matrix("export", "junit", "--campaign", "2")
    assert result.exit_code == 0, result.output
    root = validate_junit(result.output.encode())
    names = {(s.get("name"), c.get("name")) for s in root.iter("testsuite") for c in s.iter("testcase")}
    assert names == {("reference-0.1.0", "reference_disaggregated"), ("vllm-0.30.0", "vllm_agg_check")}
    assert matrix("export", "junit", "--campaign", "99").exit_code == 2


def test_markdown_summary_is_inert(matrix: Matrix, tmp_path: Path) -> None:
    populate(matrix, tmp_path)
    result = matrix("export", "markdown")
    assert result.exit_code == 0, result.output
    text = result.output
    assert text.startswith("## matrix: ")
    assert "### Failures (2)" in text and "### Flaky passes (1)" in text
    assert "worker\\_ids\\_distinct, content\\_nonblank" in text
    assert "expected: lacks vllm\\#54814" in text
    assert "<script" not in text and "hunter2" not in text


def test_json_export_is_redacted_and_lossless(matrix: Matrix, tmp_path: Path) -> None:
    populate(matrix, tmp_path)
    out = tmp_path / "r.json"
    assert matrix("export", "json", "--out", str(out), "--case", "reference_disaggregated").exit_code == 0
    data = json.loads(out.read_text())
    assert [c["cell"] for c in data["cells"]] == ["reference_disaggregated@reference-0.1.0"]
    assert data["cells"][0]["latest"]["prefill_worker_id"] == "15783270017955876104"
    everything = matrix("export", "json")
    assert "hunter2" not in everything.output and "HF_TOKEN=***" in everything.output
