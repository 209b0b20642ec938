"""`matrix campaigns list`: the ids --resume, --join and --rerun-failed take, with what each campaign holds."""

from __future__ import annotations

import json

import pytest

from tests.helpers.campaigns import add_campaign
from tests.helpers.cli import Matrix


@pytest.mark.all_databases
def test_newest_first_counted_by_latest_attempt(seeded: Matrix) -> None:
    first = add_campaign(seeded, [("reference_disaggregated", 1, "passed")], status="finished", executor="local")
    second = add_campaign(
        seeded,
        [("reference_disaggregated", 1, "failed"), ("reference_disaggregated", 2, "passed"),
         ("reference_disaggregated_gpu", 1, "pending")],
        status="running", executor="ray", key="github:o/r/7",
    )  # fmt: skip
    result = seeded("campaigns", "list", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["id"] for r in rows] == [second, first]
    assert rows[0]["outcomes"] == {"passed": 1, "pending": 1}  # the retry's pass replaces attempt 1's failure
    assert (rows[0]["status"], rows[0]["executor"], rows[0]["key"]) == ("running", "ray", "github:o/r/7")
    assert rows[1]["outcomes"] == {"passed": 1} and rows[1]["cells"] == 1

    limited = json.loads(seeded("campaigns", "list", "--json", "--limit", "1").output)
    assert [r["id"] for r in limited] == [second]
    table = seeded("campaigns", "list").output
    assert "1 passed, 1 pending" in table and "github:o/r/7" in table


def test_no_campaign_is_an_empty_list_and_a_bad_limit_exits_2(seeded: Matrix) -> None:
    assert json.loads(seeded("campaigns", "list", "--json").output) == []
    before = seeded.dump()
    result = seeded("campaigns", "list", "--limit", "0")
    assert result.exit_code == 2 and "--limit" in result.output
    assert seeded.dump() == before


