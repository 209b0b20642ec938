"""A real Dynamo (PyPI ai-dynamo) provisioned from the catalog's recipe, run by `matrix run` on the CPU.

Slow the first time (the environment is built from PyPI, ~1 minute); the environment is cached in the
test's data directory only, so every CI run proves the recipe from scratch.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.processes import assert_nothing_left

VERSION = os.environ.get("MATRIX_TEST_DYNAMO_VERSION", "1.6.1")
# The first test's setup builds the environment from PyPI and runs the cells (`matrix run` may take 900 s).
pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(1200)]


def _dynamo_logging_files() -> set[Path]:
    """The logging configurations Dynamo writes into a temporary directory at every start-up."""
    found = set()
    for path in Path(tempfile.gettempdir()).glob("tmp*.json"):
        try:  # another program's file may go, or hold anything, between the listing and the read
            if "dynamo.runtime.logging" in path.read_text(errors="replace"):
                found.add(path)
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def temp_files_before() -> set[Path]:
    return _dynamo_logging_files()


@pytest.fixture(scope="module")
def dynamo_campaign(tmp_path_factory: pytest.TempPathFactory, temp_files_before: set[Path]) -> Matrix:
    home = tmp_path_factory.mktemp("dynamo")
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    # Not the topology and peer-loss cells: test_dynamo_mocker_topology.py runs those.
    cases = ("dynamo_mocker_disaggregated", "dynamo_mocker_aggregated_control", "dynamo_mocker_response_stream_address")
    selected = [arg for case in cases for arg in ("--case", case)]
    result = m.subprocess("run", "--runtime", f"dynamo={VERSION}", *selected, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return m


def _row(m: Matrix, case: str) -> dict[str, object]:
    columns = ("uid", "status", "failure_kind", "checks", "prefill_worker_id", "decode_worker_id",
               "completion_tokens", "log_dir", "message")  # fmt: skip
    (row,) = m.sql(
        f'SELECT {", ".join("r." + c for c in columns)} FROM cell_run r JOIN "case" c ON c.id = r.case_id '
        "WHERE c.name = ?",
        case,
    )
    return dict(zip(columns, row, strict=True))


def test_disaggregated_mocker_passes_with_distinct_u64_ids(dynamo_campaign: Matrix) -> None:
    row = _row(dynamo_campaign, "dynamo_mocker_disaggregated")
    assert row["status"] == "passed", row["message"]
    prefill, decode = str(row["prefill_worker_id"]), str(row["decode_worker_id"])
    assert prefill.isdigit() and decode.isdigit() and prefill != decode
    assert all(0 <= int(v) < 2**64 for v in (prefill, decode))
    assert int(str(row["completion_tokens"])) > 1
    assert_nothing_left(dynamo_campaign, str(row["uid"]))


def test_aggregated_control_is_caught_by_the_distinct_workers_check(dynamo_campaign: Matrix) -> None:
    row = _row(dynamo_campaign, "dynamo_mocker_aggregated_control")
    assert row["status"] == "passed", row["message"]  # a control passes when its check fails
    checks = json.loads(str(row["checks"]))
    assert [c["name"] for c in checks] == ["worker_ids_distinct"]
    assert row["prefill_worker_id"] == row["decode_worker_id"]
    assert_nothing_left(dynamo_campaign, str(row["uid"]))


def test_discovery_and_cache_directories_are_removed_logs_kept(dynamo_campaign: Matrix) -> None:
    for case in ("dynamo_mocker_disaggregated", "dynamo_mocker_aggregated_control"):
        log_dir = Path(str(_row(dynamo_campaign, case)["log_dir"]))
        assert (log_dir / "frontend.log").is_file()
        assert not (log_dir / "discovery").exists() and not (log_dir / "cache").exists()


def test_dynamos_temporary_files_went_with_the_cells(dynamo_campaign: Matrix, temp_files_before: set[Path]) -> None:
    # Every Dynamo process writes a logging configuration (tmpXXXX.json) into its TMPDIR and never removes it;
    # the cell's TMPDIR is its own, removed with it, so the runner's temporary directory gains none.
    assert _dynamo_logging_files() - temp_files_before == set()
    for case in ("dynamo_mocker_disaggregated", "dynamo_mocker_aggregated_control"):
        uid = str(_row(dynamo_campaign, case)["uid"])
        assert not (Path(tempfile.gettempdir()) / f"matrix-{uid}").exists()


def test_every_listener_is_recorded_and_only_the_event_plane_leaves_loopback(dynamo_campaign: Matrix) -> None:
    # [M21] item 11, as measured on 1.6.1: the frontend, system and RPC ports keep to 127.0.0.1 (the arm's
    # DYN_*_HOST variables); the workers' event-plane ZMQ publishers bind 0.0.0.0, which no 1.6.1 variable
    # changes (docs/security.md). Recorded as evidence and said in the message; --loopback-only fails them.
    (row,) = dynamo_campaign.sql(
        'SELECT r.listeners, r.ports, r.message FROM cell_run r JOIN "case" c ON c.id = r.case_id WHERE c.name = ?',
        "dynamo_mocker_disaggregated",
    )
    listeners = row[0] if isinstance(row[0], list) else json.loads(str(row[0]))
    ports = row[1] if isinstance(row[1], dict) else json.loads(str(row[1]))
    by_port = {int(e["port"]): e for e in listeners}
    for name, port in ports.items():  # every port matrix gave out is listened on, on loopback
        assert by_port[int(port)]["address"] == "127.0.0.1", (name, by_port.get(int(port)))
    exposed = [e for e in listeners if e["address"] != "127.0.0.1"]
    assert {e["role"] for e in exposed} <= {"prefill", "decode"} and all(e["address"] == "0.0.0.0" for e in exposed)
    if exposed:
        assert "listens beyond loopback: " in str(row[2])
