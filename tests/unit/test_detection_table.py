"""The [M28] detection table (`matrix detection`, the report's detection page) read from rows as the runner
records them: each outcome made by `outcome.judge_fault` (the runner's own judgement of a fault cell) and
stored by `results.record_outcome`."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select

from matrix.check.specs import CheckFailure
from matrix.db.engine import create_db_engine, resolve_url, session_factory, transaction
from matrix.db.models import Campaign, Case, CellRun, Runtime
from matrix.outcome import CellOutcome, checked, failure, judge_fault, passed, timed_out
from matrix.results import record_outcome
from tests.helpers.cli import Matrix

CASES = """
[[case]]
name = "{name}"
backend = "vllm-cpu"
arm = "vllm_native"
model = "matrix-tiny-random"
markers = ["gpu_0"]
launch = {{ cpu = true, kv_fault = "{fault}" }}
"""
STALE = "stale on decode"


def _caught(check: str) -> CellOutcome:
    return judge_fault(checked([CheckFailure(check, "wrong")]), 12, STALE, "12 effective injection(s)")


def _record(m: Matrix, outcomes: list[tuple[str, CellOutcome]]) -> None:
    engine = create_db_engine(resolve_url(str(m.db_path)))
    try:
        with transaction(session_factory(engine)) as session:
            runtime = session.scalars(select(Runtime).where(Runtime.version == "0.32.0")).first()
            assert runtime is not None
            campaign = Campaign(selection={})
            session.add(campaign)
            session.flush()
            for index, (name, outcome) in enumerate(outcomes):
                case = session.scalars(select(Case).where(Case.name == name)).one()
                row = CellRun(uid=f"u{index}", campaign_id=campaign.id, case_id=case.id, runtime_id=runtime.id,
                              attempt=index + 1, checks=[])  # fmt: skip
                record_outcome(row, outcome)
                session.add(row)
    finally:
        engine.dispose()


def test_caught_missed_not_exercised_and_false_alarms_are_counted_apart(matrix: Matrix, tmp_path: Path) -> None:
    catalog = tmp_path / "faults.toml"
    catalog.write_text(CASES.format(name="kvf_stale", fault="stale") + CASES.format(name="kvf_none", fault="none"))
    assert matrix("catalog", "sync").exit_code == 0
    assert matrix("catalog", "sync", str(catalog)).exit_code == 0
    missed = judge_fault(passed(), 12, STALE, "12 effective injection(s)")
    idle = judge_fault(checked([CheckFailure("equivalent_to_aggregated", "wrong")]), 0, STALE, "0 effective")
    _record(matrix, [
        ("kvf_stale", _caught("equivalent_to_aggregated")), ("kvf_stale", _caught("equivalent_to_aggregated")),
        ("kvf_stale", _caught("content_nonblank")), ("kvf_stale", missed), ("kvf_stale", idle),
        ("kvf_stale", judge_fault(failure("startup", "the pair never came up"), 0, STALE, "0 effective")),
        ("kvf_stale", failure("infra", "port allocation failed")),
        ("kvf_none", passed()), ("kvf_none", passed()), ("kvf_none", checked([CheckFailure("kv_transfer", "0")])),
        ("kvf_none", timed_out("request", "no answer within 90 s")),
    ])  # fmt: skip

    result = matrix("detection", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["fault"]: row for row in json.loads(result.output)["rows"]}
    stale, healthy = rows["stale"], rows["none"]
    assert (stale["cells"], stale["caught"], stale["not_exercised"], stale["no_evidence"]) == (4, 3, 2, 1)
    assert stale["first"] == {"equivalent_to_aggregated": 2, "content_nonblank": 1} and stale["fired"] == 48
    assert stale["without_oracle"] == 1  # the cell content_nonblank caught
    low, high = stale["wilson95"]
    assert 0.3 < low < 0.75 < high < 1.0
    assert (healthy["cells"], healthy["false_alarms"], healthy["first"]) == (4, 2, {"kv_transfer": 1, "request": 1})

    table = matrix("detection", "--markdown").output
    assert "| 4 | 3/4 = 75.0% [30.1%, 95.4%] | equivalent_to_aggregated 2, content_nonblank 1 | 1/4 | 2 | 48 |" in table
    assert "| none (A/A) |" in table
    assert matrix("report", "--out", str(tmp_path / "report")).exit_code == 0
    page = (tmp_path / "report" / "detection.html").read_text()
    assert "equivalent_to_aggregated 2, content_nonblank 1" in page
    assert "1 faults missed, 2 false alarms" in (tmp_path / "report" / "index.html").read_text()


def test_bad_input_is_one_line_and_exit_2(matrix: Matrix) -> None:
    assert matrix("catalog", "sync").exit_code == 0
    for args, says in ((("--runtime", "vllm-cpu=9.9.9"), "no fault cells on runtime"),
                       (("--campaign", "41"), "no campaign 41")):  # fmt: skip
        result = matrix("detection", *args)
        assert result.exit_code == 2 and says in result.output, result.output


def test_the_table_names_the_oracle_as_the_oracle_does() -> None:
    from matrix.check.oracle import CHECK_NAME
    from matrix.report.detection import ORACLE

    assert ORACLE == CHECK_NAME
