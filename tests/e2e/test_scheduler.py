"""The scheduler on real reference pairs: concurrency, retries, fail-fast, kill -9 and resume, two runners.

Tests of claims shared between runners (resume, join) run on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import time

import psutil
import pytest

from tests.helpers.cli import DATA, Matrix
from tests.helpers.processes import assert_nothing_left, cell_processes


def write_catalog(m: Matrix, cases: dict[str, dict[str, object]]) -> None:
    """Seed backends/markers/fixes/runtimes plus the given reference cases (name -> launch options)."""
    lines = []
    for name, options in cases.items():
        launch = dict(options)
        startup = launch.pop("startup_timeout_s", 30)
        items = ", ".join(f"{k} = {json.dumps(v)}" for k, v in launch.items())
        lines += [
            "[[case]]",
            f'name = "{name}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0", "e2e"]',
            f"startup_timeout_s = {startup}",
            f"launch = {{ {items} }}",
            "",
        ]
    catalog = m.home / "catalog"
    catalog.mkdir(exist_ok=True)
    (catalog / "cases.toml").write_text("\n".join(lines))
    files = [str(catalog / "cases.toml")] + [
        str(DATA / n) for n in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")
    ]
    result = m.subprocess("catalog", "sync", *files)
    assert result.returncode == 0, result.stdout + result.stderr


def rows(m: Matrix) -> list[dict[str, object]]:
    columns = ("uid", "name", "attempt", "status", "failure_kind", "flaky", "started_at", "finished_at")
    found = m.sql(
        f'SELECT cell_run.uid, "case".name, {", ".join("cell_run." + c for c in columns[2:])} '
        'FROM cell_run JOIN "case" ON case_id = "case".id ORDER BY cell_run.id'
    )
    return [dict(zip(columns, r, strict=True)) for r in found]


def _t(value: object) -> float:
    return dt.datetime.fromisoformat(str(value)).timestamp()


def max_overlap(found: list[dict[str, object]]) -> int:
    events = sorted([(_t(r["started_at"]), 1) for r in found] + [(_t(r["finished_at"]), -1) for r in found])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_jobs_run_cells_concurrently(matrix: Matrix) -> None:
    write_catalog(matrix, {f"slow{i}": {"faults": ["slow-start"], "slow_start_s": 1.5} for i in range(6)})
    result = matrix.subprocess("run", "--backend", "reference", "--jobs", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    found = rows(matrix)
    assert [r["status"] for r in found] == ["passed"] * 6
    assert max_overlap(found) >= 3  # 4 slots; start-ups of CPU cells are not serialised
    for r in found:
        assert_nothing_left(matrix, str(r["uid"]))


def test_retries_only_startup_failures_and_mark_flaky(matrix: Matrix) -> None:
    write_catalog(
        matrix,
        {
            "always_crashes": {"faults": ["crash-at-start"]},
            "crashes_once": {"faults": ["crash-once"]},
            "bad_ids": {"faults": ["same-worker-id"]},
        },
    )
    result = matrix.subprocess("run", "--backend", "reference", "--max-attempts", "3", "--jobs", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    by_case: dict[str, list[dict[str, object]]] = {}
    for r in rows(matrix):
        by_case.setdefault(str(r["name"]), []).append(r)
    assert [r["attempt"] for r in by_case["always_crashes"]] == [1, 2, 3]
    assert {r["failure_kind"] for r in by_case["always_crashes"]} == {"startup"}
    assert [(r["status"], r["flaky"]) for r in by_case["crashes_once"]] == [("failed", 0), ("passed", 1)]
    assert [r["attempt"] for r in by_case["bad_ids"]] == [1]  # validation failures are never retried
    assert "flaky" in result.stdout


def test_fail_fast_marks_the_rest_not_run(matrix: Matrix) -> None:
    # The crashing case has the longest timeout, so longest-expected-first runs it first.
    cases: dict[str, dict[str, object]] = {"crash_first": {"faults": ["crash-at-start"], "startup_timeout_s": 90}}
    cases |= {f"later{i}": {"faults": []} for i in range(3)}
    write_catalog(matrix, cases)
    result = matrix.subprocess("run", "--backend", "reference", "--jobs", "1", "-x")
    assert result.returncode == 1, result.stdout + result.stderr
    statuses = {str(r["name"]): r["status"] for r in rows(matrix)}
    assert statuses == {"crash_first": "failed", "later0": "not-run", "later1": "not-run", "later2": "not-run"}
    assert "fail-fast" in result.stdout


def _wait_for(m: Matrix, predicate: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m.exists() and predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


@pytest.mark.all_databases
def test_kill_9_then_resume_finishes_every_cell_exactly_once(matrix: Matrix) -> None:
    write_catalog(matrix, {f"slow{i}": {"faults": ["slow-start"], "slow_start_s": 1.0} for i in range(6)})
    proc = matrix.popen("run", "--backend", "reference", "--jobs", "2")

    def progressed() -> bool:
        states = [r["status"] for r in rows(matrix)]
        return states.count("passed") >= 2 and states.count("running") >= 1

    _wait_for(matrix, progressed)
    proc.kill()
    proc.wait(timeout=10)
    at_kill = rows(matrix)
    running = [str(r["uid"]) for r in at_kill if r["status"] == "running"]
    never_started = {str(r["name"]) for r in at_kill if r["status"] == "pending"}
    assert never_started  # the campaign recorded every planned cell up front
    result = matrix.subprocess("run", "--resume", "1", "--jobs", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    final = rows(matrix)
    for uid in running:
        assert next(r for r in final if r["uid"] == uid)["status"] == "interrupted"
        assert_nothing_left(matrix, uid)
    passed = [str(r["name"]) for r in final if r["status"] == "passed"]
    assert sorted(passed) == [f"slow{i}" for i in range(6)]  # every cell exactly once
    assert {r["status"] for r in final} <= {"passed", "interrupted"}
    # A cell that never started keeps its first attempt; an interrupted one gets a second.
    assert {r["attempt"] for r in final if r["name"] in never_started} == {1}
    assert matrix.sql("SELECT status FROM campaign") == [("finished",)]
    assert all(not cell_processes(str(r["uid"])) for r in final)


def test_rerun_failed_after_kill_9_runs_what_never_ran_and_marks_nothing_flaky(matrix: Matrix) -> None:
    """An interruption is not a failure of the cell: its rerun passing is not flaky, and cells the dead runner
    never started are run too, so no `pending` row is left behind."""
    write_catalog(matrix, {f"slow{i}": {"faults": ["slow-start"], "slow_start_s": 1.0} for i in range(4)})
    proc = matrix.popen("run", "--backend", "reference", "--jobs", "1")
    _wait_for(matrix, lambda: [r["status"] for r in rows(matrix)].count("running") == 1)
    proc.kill()
    proc.wait(timeout=10)
    assert "pending" in {r["status"] for r in rows(matrix)}
    result = matrix.subprocess("run", "--rerun-failed", "1", "--jobs", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    final = rows(matrix)
    assert "pending" not in {r["status"] for r in final}
    assert sorted(str(r["name"]) for r in final if r["status"] == "passed") == [f"slow{i}" for i in range(4)]
    assert matrix.sql("SELECT COUNT(*) FROM cell_run WHERE flaky") == [(0,)]
    assert "flaky" not in result.stdout
    assert matrix.sql("SELECT status FROM campaign") == [("finished",)]


@pytest.mark.all_databases
def test_two_runners_on_one_database_never_run_a_cell_twice(matrix: Matrix) -> None:
    write_catalog(matrix, {f"slow{i}": {"faults": ["slow-start"], "slow_start_s": 0.8} for i in range(8)})
    first = matrix.popen("run", "--backend", "reference", "--jobs", "2")
    _wait_for(matrix, lambda: any(r["status"] == "running" for r in rows(matrix)))
    second = matrix.subprocess("run", "--resume", "1", "--jobs", "2", timeout=120)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out
    assert second.returncode == 0, second.stdout + second.stderr
    final = rows(matrix)
    assert sorted(str(r["name"]) for r in final) == [f"slow{i}" for i in range(8)]  # one row per cell
    assert {r["status"] for r in final} == {"passed"}


def test_sigterm_with_concurrent_cells_interrupts_all_and_leaves_nothing(matrix: Matrix) -> None:
    write_catalog(
        matrix, {f"hang{i}": {"faults": ["slow-start"], "slow_start_s": 60, "startup_timeout_s": 120} for i in range(3)}
    )
    proc = matrix.popen("run", "--backend", "reference", "--jobs", "3")
    _wait_for(matrix, lambda: sum(r["status"] == "running" for r in rows(matrix)) == 3)
    uids = [str(r["uid"]) for r in rows(matrix)]
    _wait_for(matrix, lambda: all(len(cell_processes(u)) == 3 for u in uids))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert {r["status"] for r in rows(matrix)} == {"interrupted"}
    for uid in uids:
        assert_nothing_left(matrix, uid)


def passed_count(output: str) -> int:
    """The passed cells a `--json-events` runner counted in its campaign-end event."""
    ends = [json.loads(line) for line in output.splitlines() if line.startswith('{"') and "campaign-end" in line]
    assert len(ends) == 1, output
    return int(ends[0]["counts"].get("passed", 0))


def owners(m: Matrix) -> list[tuple[object, ...]]:
    return m.sql("SELECT owner_pid, count(*) FROM cell_run GROUP BY owner_pid ORDER BY owner_pid")


@pytest.mark.all_databases
def test_join_shares_a_campaign_and_every_cell_finishes_exactly_once(matrix: Matrix) -> None:
    names = [f"slow{i}" for i in range(8)]
    write_catalog(matrix, {name: {"faults": ["slow-start"], "slow_start_s": 1.5} for name in names})
    owner = matrix.popen("run", "--backend", "reference", "--jobs", "2", "--no-report", "--json-events")
    _wait_for(matrix, lambda: any(r["status"] == "running" for r in rows(matrix)))
    # Every planned cell has its row from the start: the joiner claims pending ones.
    assert sorted(str(r["name"]) for r in rows(matrix)) == names
    joiner = matrix.popen("run", "--join", "1", "--jobs", "2", "--no-report", "--json-events")
    owner_out, _ = owner.communicate(timeout=180)
    joiner_out, _ = joiner.communicate(timeout=180)
    assert owner.returncode == 0, owner_out
    assert joiner.returncode == 0, joiner_out
    assert "joining campaign 1" in joiner_out
    final = rows(matrix)
    assert sorted(str(r["name"]) for r in final) == names  # one row per cell: nothing ran twice
    assert {(r["status"], r["attempt"]) for r in final} == {("passed", 1)}
    # ... and no runner ran a cell another one ran: the passes both runners counted add up to the cells.
    ran = [passed_count(out) for out in (owner_out, joiner_out)]
    assert sum(ran) == len(names) and min(ran) > 0, ran
    # Both runners ran cells, and each row names the runner that ran it.
    assert {pid for pid, _ in owners(matrix)} == {owner.pid, joiner.pid}
    assert matrix.sql("SELECT status, finished_at IS NOT NULL FROM campaign") == [("finished", True)]
    for r in final:
        assert_nothing_left(matrix, str(r["uid"]))
    assert not psutil.pid_exists(owner.pid) and not psutil.pid_exists(joiner.pid)


@pytest.mark.all_databases
def test_join_refuses_what_it_cannot_join_and_leaves_the_database_unchanged(matrix: Matrix) -> None:
    write_catalog(matrix, {"quick": {"faults": []}})
    before = matrix.dump()
    missing = matrix.subprocess("run", "--join", "7")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "no campaign 7 to join" in missing.stderr
    assert matrix.dump() == before
    done = matrix.subprocess("run", "--backend", "reference", "--no-report")
    assert done.returncode == 0, done.stdout + done.stderr
    before = matrix.dump()
    cases = {
        ("--join", "1"): ["campaign 1 is finished", "matrix run --resume 1"],
        ("--join", "1", "--resume", "1"): ["--join helps with a running campaign"],
        ("--join", "1", "--rerun-failed"): ["--join helps with a running campaign"],
        ("--join", "1", "-m", "e2e", "--backend", "reference"): ["drop -m, --backend"],
        ("--join", "1", "--cell", "reference_disaggregated@reference-0.1.0"): ["cannot be combined with --resume"],
    }
    for args, needles in cases.items():
        result = matrix.subprocess("run", *args)
        assert result.returncode == 2, (args, result.stdout + result.stderr)
        for needle in needles:
            assert needle in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert matrix.dump() == before, args
