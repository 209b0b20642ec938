"""`matrix run` on real reference pairs: healthy cells pass, every planted fault is caught, nothing leaks.

Each fault of the reference server is a case in a small catalog; one campaign runs them all through the
real CLI, then every row is checked for its expected status, failure kind and check name, and the host
is checked for leftover processes and ports.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from matrix.reference.faults import FAULTS
from tests.helpers.cli import DATA, Matrix
from tests.helpers.processes import assert_nothing_left, cell_processes
from tests.helpers.reference_cells import SHORT_GRACE

# fault -> (status, failure kind, failed check or None)
EXPECTED: dict[str, tuple[str, str | None, str | None]] = {
    "crash-at-start": ("failed", "startup", None),
    "crash-once": ("failed", "startup", None),  # one attempt only here; retried in test_scheduler
    "flaky-start": ("failed", "startup", None),  # rate 1 unless MATRIX_REFERENCE_FLAKE_RATE says otherwise
    "hang-at-start": ("timeout", "health", None),
    # An engine that refuses a dependency of matrix's recipe at start-up: the recipe's fault (test_recipe_fault).
    "unmet-dependency": ("failed", "recipe", None),
    "slow-start": ("timeout", "health", None),
    "same-worker-id": ("failed", "validation", "worker_ids_distinct"),
    "empty-completion": ("failed", "validation", "content_nonblank"),
    "one-token-completion": ("failed", "validation", "completion_tokens"),
    "missing-usage": ("failed", "validation", "usage_object"),
    "bad-finish-reason": ("failed", "validation", "finish_reason"),
    "non-json-body": ("failed", "validation", "json_body"),
    "oversized-body": ("failed", "request", "response_size"),
    "kv-transfer-dropped": ("failed", "validation", "http_status"),
    # Decode's KV handshake refuses the peer's block size and answers 500 (test_skew_refusal_processes).
    "kv-handshake-refusal": ("failed", "validation", "http_status"),
    # KV that never comes and nobody times out: matrix cuts the request at its timeout (a hang).
    "kv-transfer-stall": ("timeout", "request", "request"),
    "ignore-sigterm": ("failed", "teardown", "graceful_exit"),
    "escaped-child": ("failed", "teardown", "no_escaped_processes"),
    # Hostile bytes are not a failure: the pair serves; what it printed is cleaned (test_hostile_corpus).
    "hostile-output": ("passed", None, None),
    # A planted slowdown serves correctly, only later (test_confidence_reference measures it).
    "slow-request": ("passed", None, None),
    # KV corrupted after its checksum passed: no check but the equivalence oracle sees it, and these cases
    # do not opt in (test_equivalence_oracle.py runs it with the oracle).
    "kv-corrupt-after-checksum": ("passed", None, None),
    # Listening on every interface is said, not failed, unless `--loopback-only` (test below).
    "listen-everywhere": ("passed", None, None),
    # A streamed request's KV kept after its client dropped it; a decode that holds its slot for KV that
    # never came; a prefill that keeps KV decode already read. Each fails exactly its lifecycle check
    # (test_lifecycle_faults_fail_exactly_their_check).
    "leak-on-cancel": ("failed", "validation", "cancel_recovers"),
    "kv-read-report-lost": ("failed", "validation", "kv_released_after_answer"),
    "hold-orphan-decode": ("failed", "validation", "orphan_decode_released"),
    # Faults only concurrent traffic shows: one request at a time passes (test_traffic_reference runs them
    # under a traffic profile, where each fails its cell with its class named).
    "stale-kv-after-reuse": ("passed", None, None),
    "kv-swap-in-flight": ("passed", None, None),
    "n-child-handoff-lost": ("passed", None, None),
    "peer-loss-hang": ("passed", None, None),
    # Leaves out a decode only where there are several: a 1P1D pair passes (test_topology_reference runs it
    # on 1p2d, where it fails topology_worker_unused).
    "topology-decode-unused": ("passed", None, None),
    # Act only when a worker dies: a pair whose workers all live passes (test_peer_loss_reference kills them).
    "dead-peer-hang": ("passed", None, None),
    "dead-peer-truncation": ("passed", None, None),
    "dead-peer-never-rejoins": ("passed", None, None),
    "dead-peer-still-routed": ("passed", None, None),
    "dead-peer-kv-held": ("passed", None, None),
}


def case_name(fault: str) -> str:
    return "fault_" + fault.replace("-", "_")


def fault_catalog(directory: Path, *, extra: str = "") -> list[str]:
    """The seed's backends, markers, fixes and runtimes plus one reference case per fault."""
    lines = []
    for fault in sorted(FAULTS):
        startup = 1.5 if fault in ("hang-at-start", "slow-start") else 20
        lines += [
            "[[case]]",
            f'name = "{case_name(fault)}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0", "e2e"]',
            f"startup_timeout_s = {startup}\nrequest_timeout_s = 10",
            f'launch = {{ faults = ["{fault}"], slow_start_s = 4{SHORT_GRACE.get(fault, "")} }}',
            "",
        ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "faults.toml").write_text("\n".join(lines) + extra)
    files = [directory / "faults.toml"]
    for name in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml", "cases.toml"):
        files.append(DATA / name)
    return [str(f) for f in files]


@pytest.fixture(scope="module")
def fault_campaign(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("faults")
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync", *fault_catalog(home / "catalog")).returncode == 0
    result = m.subprocess("run", "--backend", "reference", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr  # some cells fail on purpose
    return m


def _row(m: Matrix, case: str) -> dict[str, object]:
    columns = ("uid", "status", "failure_kind", "checks", "message", "prefill_worker_id", "decode_worker_id",
               "completion_tokens", "ready_s", "request_s", "teardown_s", "total_s")  # fmt: skip
    rows = m.sql(
        f'SELECT {", ".join(columns)} FROM cell_run JOIN "case" ON case_id = "case".id WHERE name = ? '
        "ORDER BY cell_run.id DESC",
        case,
    )
    assert rows, f"no row for {case}"
    row = dict(zip(columns, rows[0], strict=True))
    row["checks"] = json.loads(str(row["checks"]))
    return row


def test_healthy_reference_pair_passes_every_check(fault_campaign: Matrix) -> None:
    row = _row(fault_campaign, "reference_disaggregated")
    assert row["status"] == "passed", row["message"]
    assert row["checks"] == []
    prefill, decode = int(str(row["prefill_worker_id"])), int(str(row["decode_worker_id"]))
    assert prefill != decode and 0 <= prefill < 2**64 and 0 <= decode < 2**64
    assert int(str(row["completion_tokens"])) > 1
    for timing in ("ready_s", "request_s", "teardown_s", "total_s"):
        assert isinstance(row[timing], float)
    assert_nothing_left(fault_campaign, str(row["uid"]))


@pytest.mark.parametrize(("fault", "check"), [("leak-on-cancel", "cancel_recovers"),
                                             ("hold-orphan-decode", "orphan_decode_released"),
                                             ("kv-read-report-lost", "kv_released_after_answer")])  # fmt: skip
def test_lifecycle_faults_fail_exactly_their_check(fault_campaign: Matrix, fault: str, check: str) -> None:
    """Only the targeted checks fail, and the evidence (gauges before, during, after) shows why."""
    row = _row(fault_campaign, case_name(fault))
    # A prefill that keeps every pulled request's KV also keeps the dropped stream's: cancel_recovers sees it too.
    also = {"cancel_recovers"} if fault == "kv-read-report-lost" else set()
    assert {c["name"] for c in row["checks"]} == {check} | also, row["checks"]  # type: ignore[union-attr]
    (log_dir,) = fault_campaign.sql("SELECT log_dir FROM cell_run WHERE uid = ?", row["uid"])[0]
    evidence = json.loads((Path(str(log_dir)) / f"{check}.json").read_text())
    if fault == "kv-read-report-lost":
        # Prefill still holds the answered requests' blocks at the bound; decode freed its own at once.
        assert evidence["passed"] is False and evidence["still_held_after_s"] >= 10.0, evidence
        assert evidence["after"]["prefill"]["kv_usage"] > 0 and not evidence["after"]["decode"]["kv_usage"], evidence
        return
    assert evidence["passed"] is False and evidence["before"] and evidence["during"], evidence
    decode_after = evidence["after"]["decode"]
    if fault == "leak-on-cancel":
        assert decode_after["kv_usage"] > evidence["before"]["decode"]["kv_usage"], evidence
    else:
        assert decode_after["waiting"] == 1, evidence


def test_healthy_pair_streams_cancels_and_releases_an_orphaned_decode(fault_campaign: Matrix) -> None:
    """The healthy reference pair passes the lifecycle checks, with their evidence kept beside its logs."""
    row = _row(fault_campaign, "reference_disaggregated")
    (log_dir,) = fault_campaign.sql("SELECT log_dir FROM cell_run WHERE uid = ?", row["uid"])[0]
    for name in ("stream.json", "kv_released_after_answer.json", "cancel_recovers.json", "orphan_decode_released.json"):
        evidence = json.loads((Path(str(log_dir)) / name).read_text())
        assert evidence.get("passed", True) is True and not evidence.get("failures"), evidence
    released = json.loads((Path(str(log_dir)) / "kv_released_after_answer.json").read_text())
    assert released["released_s"] < 10.0 and all(not any(r.values()) for r in released["after"].values()), released
    cancel = json.loads((Path(str(log_dir)) / "cancel_recovers.json").read_text())
    assert cancel["during"]["decode"]["running"] == 1 and not cancel["stream_ended_before_drop"], cancel
    assert cancel["after"]["decode"]["kv_usage"] <= cancel["before"]["decode"]["kv_usage"], cancel


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_planted_fault_is_caught_and_leaves_nothing(fault_campaign: Matrix, fault: str) -> None:
    status, kind, check = EXPECTED[fault]
    row = _row(fault_campaign, case_name(fault))
    assert (row["status"], row["failure_kind"]) == (status, kind), row["message"]
    if check is not None:
        assert check in {c["name"] for c in row["checks"]}, row["checks"]  # type: ignore[union-attr]
    if kind in ("startup", "health"):
        # The pair never got ready: no ready time (a timeout's 120 s would read as a slow start-up).
        assert row["ready_s"] is None, row["ready_s"]
    assert_nothing_left(fault_campaign, str(row["uid"]))


def test_every_reference_fault_has_an_expectation() -> None:
    assert set(EXPECTED) == FAULTS


def _listeners(m: Matrix, case: str) -> list[dict[str, object]]:
    (value,) = m.sql(
        'SELECT listeners FROM cell_run JOIN "case" ON case_id = "case".id WHERE name = ? ORDER BY cell_run.id DESC',
        case,
    )[0]
    return value if isinstance(value, list) else json.loads(str(value))  # PostgreSQL decodes JSON


def test_every_listening_socket_is_recorded_and_one_beyond_loopback_is_said(fault_campaign: Matrix) -> None:
    # [M21] item 11: the reference pair listens on 127.0.0.1 only (frontend, prefill, decode and prefill's
    # KV side channel); the listen-everywhere fault adds a socket on 0.0.0.0, as Dynamo's publishers do.
    healthy = _listeners(fault_campaign, case_name("hostile-output"))
    assert {e["role"] for e in healthy} == {"frontend", "prefill", "decode"}, healthy
    assert all(e["address"] == "127.0.0.1" and e["proto"] == "tcp" for e in healthy), healthy
    assert "beyond loopback" not in str(_row(fault_campaign, case_name("hostile-output"))["message"])
    exposed = [e for e in _listeners(fault_campaign, case_name("listen-everywhere")) if e["address"] == "0.0.0.0"]
    assert [e["role"] for e in exposed] == ["prefill"], exposed
    row = _row(fault_campaign, case_name("listen-everywhere"))
    assert row["status"] == "passed"
    assert row["message"] == f"listens beyond loopback: prefill 0.0.0.0:{exposed[0]['port']}/tcp"
    shown = fault_campaign.subprocess("show", str(row["uid"]))
    assert shown.returncode == 0 and f"prefill 0.0.0.0:{exposed[0]['port']}/tcp" in shown.stdout, shown.stdout


def test_loopback_only_fails_a_cell_that_listens_beyond_loopback(fault_campaign: Matrix) -> None:
    result = fault_campaign.subprocess(
        "run", "--case", case_name("listen-everywhere"), "--case", case_name("hostile-output"), "--loopback-only",
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    row = _row(fault_campaign, case_name("listen-everywhere"))
    assert (row["status"], row["failure_kind"]) == ("failed", "validation"), row
    assert [c["name"] for c in row["checks"]] == ["loopback_only"]  # type: ignore[union-attr, index]
    assert "listens beyond loopback: prefill 0.0.0.0:" in str(row["message"])
    assert _row(fault_campaign, case_name("hostile-output"))["status"] == "passed"
    assert_nothing_left(fault_campaign, str(row["uid"]))


def test_refused_request_carries_the_engines_error_lines(fault_campaign: Matrix) -> None:
    """A pair that answered an HTTP error keeps why in its message: the error lines of the processes' logs."""
    row = _row(fault_campaign, case_name("kv-transfer-dropped"))
    message = str(row["message"])
    assert message.startswith("failed checks: http_status"), message
    assert "--- error lines (decode.log) ---" in message and "KV transfer failed" in message, message
    healthy = _row(fault_campaign, "reference_disaggregated")
    assert "error lines" not in str(healthy["message"])


def test_crash_message_carries_the_log_tail(fault_campaign: Matrix) -> None:
    row = _row(fault_campaign, case_name("crash-at-start"))
    assert "exited with code 1 before it was ready" in str(row["message"])
    assert "last log lines" in str(row["message"])


def test_show_prints_the_outcome_and_log_paths(fault_campaign: Matrix) -> None:
    row = _row(fault_campaign, case_name("same-worker-id"))
    result = fault_campaign.subprocess("show", str(row["uid"]))
    assert result.returncode == 0
    assert "check failed: worker_ids_distinct" in result.stdout
    assert "frontend.log" in result.stdout


def test_second_run_makes_a_second_campaign(matrix: Matrix) -> None:
    assert matrix("catalog", "sync").exit_code == 0
    for _ in range(2):
        result = matrix.subprocess("run", "--backend", "reference", "--case", "reference_disaggregated")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 passed" in result.stdout
    assert matrix.sql("SELECT id, status FROM campaign ORDER BY id") == [(1, "finished"), (2, "finished")]
    assert matrix.sql("SELECT count(*) FROM cell_run WHERE status = 'passed'") == [(2,)]


# --- the runner itself is killed ---------------------------------------------------------------------------


SLOW_CASE = """
[[case]]
name = "slow_pair"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 120
launch = { faults = ["slow-start"], slow_start_s = 60 }
"""


def _start_slow_run(m: Matrix) -> tuple[object, str]:
    assert m.subprocess("catalog", "sync", *fault_catalog(m.home / "catalog", extra=SLOW_CASE)).returncode == 0
    proc = m.popen("run", "--case", "slow_pair")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = m.sql("SELECT uid FROM cell_run WHERE status = 'running'") if m.db_path.exists() else []
        if rows and len(cell_processes(str(rows[0][0]))) >= 3:
            return proc, str(rows[0][0])
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the slow pair never started")


def test_sigterm_to_the_runner_tears_down_and_marks_interrupted(matrix: Matrix) -> None:
    proc, uid = _start_slow_run(matrix)
    proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
    output, _ = proc.communicate(timeout=30)  # type: ignore[attr-defined]
    assert proc.returncode == 3, output  # type: ignore[attr-defined]
    assert "INTERRUPTED" in output
    assert matrix.sql("SELECT status FROM cell_run WHERE uid = ?", uid) == [("interrupted",)]
    assert matrix.sql("SELECT status FROM campaign") == [("interrupted",)]
    assert_nothing_left(matrix, uid)


def test_sigkill_of_the_runner_is_cleaned_up_by_the_next_run(matrix: Matrix) -> None:
    """A SIGKILLed runner writes nothing more: its cell's watchdog kills the pair within moments, and the
    attempt's row, left `running`, is marked `interrupted` by the next run."""
    proc, uid = _start_slow_run(matrix)
    proc.kill()  # type: ignore[attr-defined]
    proc.wait(timeout=10)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 15  # a hang guard for a loaded host: the watchdog acts at once
    while cell_processes(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cell_processes(uid) == [], "the watchdog should kill the pair of a SIGKILLed runner"
    assert matrix.sql("SELECT status FROM cell_run WHERE uid = ?", uid) == [("running",)]
    result = matrix.subprocess("run", "--case", "reference_disaggregated")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"recovered {uid}" in result.stdout
    assert matrix.sql("SELECT status FROM cell_run WHERE uid = ?", uid) == [("interrupted",)]
    assert_nothing_left(matrix, uid)
