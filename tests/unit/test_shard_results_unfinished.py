"""A shard stopped part-way still gives an importable results file: rows never started stay behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrix.db.engine import create_db_engine, resolve_url, session_factory
from matrix.fanout.shard_results import read_results, write_results
from tests.helpers.campaigns import add_campaign
from tests.helpers.cli import Matrix


@pytest.mark.all_databases
def test_pending_and_running_rows_are_left_out_and_the_file_imports(seeded: Matrix, tmp_path: Path) -> None:
    campaign = add_campaign(
        seeded,
        [("reference_disaggregated", 1, "interrupted"), ("reference_disaggregated", 2, "running"),
         ("reference_disaggregated_gpu", 1, "pending")],
        key="ci:run-7", status="interrupted",
    )  # fmt: skip
    path = tmp_path / "shard.json"
    engine = create_db_engine(resolve_url(seeded.db_url or str(seeded.db_path)))
    try:
        with session_factory(engine)() as session:
            written = write_results(session, campaign, path, "ci:run-7")
    finally:
        engine.dispose()
    assert written == 1
    results = read_results(path)  # refuses unfinished statuses: it must not see any
    assert [(a.key, a.attempt, a.outcome["status"]) for a in results.attempts] == [
        ("reference_disaggregated@reference-0.1.0", 1, "interrupted")
    ]
    assert "reference_disaggregated_gpu@reference-0.1.0" in results.campaign.selection["cells"]  # still planned

    imported = seeded("import", str(path))  # into the database it came from: the attempt is already here
    assert imported.exit_code == 0, imported.output
    assert "1 already present" in imported.output or "present" in imported.output, imported.output


def test_a_shard_written_before_the_kv_ledger_still_reads(seeded: Matrix, tmp_path: Path) -> None:
    """[M15]: shards of an earlier matrix have no `kv_ledger`; they read as "not measured", not as broken."""
    import json

    campaign = add_campaign(seeded, [("reference_disaggregated", 1, "passed")], key="ci:old", status="finished")
    path = tmp_path / "shard.json"
    engine = create_db_engine(resolve_url(seeded.db_url or str(seeded.db_path)))
    try:
        with session_factory(engine)() as session:
            write_results(session, campaign, path, "ci:old")
    finally:
        engine.dispose()
    data = json.loads(path.read_text())
    for cell in data["cells"]:
        del cell["kv_ledger"]
    path.write_text(json.dumps(data))
    (attempt,) = read_results(path).attempts
    assert attempt.outcome["kv_ledger"] == {}
