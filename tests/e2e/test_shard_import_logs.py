"""[M11] item 10: an imported attempt reads only the logs its shard carried, never a host directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from matrix.db.engine import create_db_engine, resolve_url, session_factory
from matrix.fanout.shard_results import write_results
from tests.helpers.campaigns import add_campaign
from tests.helpers.cli import DATA, Matrix


@pytest.mark.all_databases
def test_a_shard_naming_a_host_directory_brings_nothing_of_it(seeded: Matrix, tmp_path: Path) -> None:
    campaign = add_campaign(seeded, [("reference_disaggregated", 1, "failed")], key="ci:run-9", status="finished")
    path = tmp_path / "shard.json"
    engine = create_db_engine(resolve_url(seeded.db_url or str(seeded.db_path)))
    try:
        with session_factory(engine)() as session:
            write_results(session, campaign, path, "ci:run-9")
    finally:
        engine.dispose()
    # A directory of this host full of logs that have nothing to do with the attempt (think /var/log).
    host_logs = tmp_path / "var-log"
    host_logs.mkdir()
    (host_logs / "dpkg.log").write_text("status installed secret-package-list\n")
    data = json.loads(path.read_text())
    data["cells"][0]["logs"] = {}
    data["cells"][0]["source_log_dir"] = str(host_logs)
    path.write_text(json.dumps(data))

    other = Matrix(home=tmp_path / "central", db_path=tmp_path / "central" / "matrix.db", db_url=None)
    other.home.mkdir()
    assert other.subprocess("catalog", "sync", *map(str, sorted(DATA.glob("*.toml")))).returncode == 0
    imported = other.subprocess("import", str(path))
    assert imported.returncode == 0, imported.stderr
    assert other.sql("SELECT log_dir FROM cell_run") == [("",)]
    shown = other.subprocess("show", data["cells"][0]["uid"], "--json")
    assert json.loads(shown.stdout)["logs"] == {}
    report = other.subprocess("report", "--out", str(other.home / "report"))
    assert report.returncode == 0, report.stderr
    pages = "".join(p.read_text() for p in (other.home / "report").glob("*.html"))
    assert "dpkg" not in pages and "secret-package-list" not in pages
    junit = other.subprocess("export", "junit")
    assert "secret-package-list" not in junit.stdout
