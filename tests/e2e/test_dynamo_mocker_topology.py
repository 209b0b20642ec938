"""[M27] xPyD topologies and peer loss on a real Dynamo (PyPI ai-dynamo, the catalog's recipe) with its mocker
engine on the CPU: several mocker workers per role registered behind one `dynamo.frontend`, run by `matrix run`.

A topology cell passes only if every worker served (its instance id, the `worker_id` label of its system
/metrics, named in the answers) and each decode's generate requests cover the choices of its pairs (the mocker
moves no KV; its answers are random tokens, so no oracle judges its streams). A peer-loss cell kills (-9) one
worker per role with streams in flight and starts it again: what each kill did is asserted as Dynamo 1.6.1
does it (docs/results/traffic.md). Then the runner of a third run is killed (-9) while the peer-loss check has
a restarted worker up: the cell's watchdog must take every process down.

Slow the first time (the environment is built from PyPI, ~1 minute); then about a minute of cells.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import Matrix
from tests.helpers.processes import assert_nothing_left, home_cell_processes, port_still_held

VERSION = os.environ.get("MATRIX_TEST_DYNAMO_VERSION", "1.6.1")
pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(1200)]

TOPOLOGIES = {"dynamo_mocker_topology_2p2d": (2, 2), "dynamo_mocker_topology_1p2d": (1, 2),
              "dynamo_mocker_topology_2p1d": (2, 1)}  # fmt: skip
PEER_LOSS = ("dynamo_mocker_peer_loss_2p2d", "dynamo_mocker_peer_loss_1p1d")
COLUMNS = ("uid", "status", "checks", "message", "log_dir")


@pytest.fixture(scope="module")
def mocker(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("dynamo-topology")
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    selected = [arg for case in (*TOPOLOGIES, *PEER_LOSS) for arg in ("--case", case)]
    result = m.subprocess("run", "--runtime", f"dynamo={VERSION}", *selected, "--no-report", timeout=900)
    assert result.returncode in (0, 1), result.stdout[-6000:] + result.stderr[-4000:]
    return m


def _row(m: Matrix, case: str) -> dict[str, object]:
    rows = m.sql(f'SELECT {", ".join("r." + c for c in COLUMNS)} FROM cell_run r JOIN "case" c ON c.id = r.case_id '
                 "WHERE c.name = ? ORDER BY r.id", case)  # fmt: skip
    return dict(zip(COLUMNS, rows[0], strict=True))


def _json(row: dict[str, object], name: str) -> dict[str, object]:
    found: dict[str, object] = json.loads((Path(str(row["log_dir"])) / name).read_text())
    return found


@pytest.mark.parametrize("case", list(TOPOLOGIES))
def test_every_worker_serves_and_every_decode_took_the_handoffs_of_its_pairs(mocker: Matrix, case: str) -> None:
    prefills, decodes = TOPOLOGIES[case]
    row = _row(mocker, case)
    assert row["status"] == "passed", row["message"]
    record = _json(row, "topology.json")
    workers = record["workers"]
    assert isinstance(workers, list) and len(workers) == prefills + decodes
    assert [w["role"] for w in workers].count("prefill") == prefills
    # Each worker's id is Dynamo's u64 instance id (its worker_id label), distinct, and each served.
    ids = [w["instance_id"] for w in workers]
    assert all(str(i).isdigit() and int(str(i)) < 2**64 for i in ids) and len(set(ids)) == len(ids), ids
    assert all(w["served"] > 0 for w in workers), workers
    pairs = record["pairs"]
    assert isinstance(pairs, list) and pairs and record["failures"] == []
    for decode in (w for w in workers if w["role"] == "decode"):
        rows = [p for p in pairs if p["pair"].endswith(f"-> {decode['name']}")]
        assert rows and all(p["kv_transfers"] >= sum(r["choices"] for r in rows) for p in rows), rows
    assert_nothing_left(mocker, str(row["uid"]))


def _rounds(row: dict[str, object]) -> list[dict[str, object]]:
    rounds = _json(row, "peer_loss.json")["rounds"]
    assert isinstance(rounds, list)
    return rounds


@pytest.mark.parametrize("case", PEER_LOSS)
def test_each_role_loses_a_worker_under_load_and_it_rejoins(mocker: Matrix, case: str) -> None:
    row = _row(mocker, case)
    assert row["status"] == "passed", row["message"]
    rounds = _rounds(row)
    assert [r["role"] for r in rounds] == ["prefill", "decode"]
    for record in rounds:
        # The kill took effect (SIGKILL, reaped, the pid gone) and a new process served under a new instance id.
        assert record["exit_code"] == -9 and not psutil.pid_exists(int(str(record["pid"]))), record
        assert record["new_pid"] not in (None, record["pid"]) and record["failures"] == []
        served = record["served_after_rejoin"]
        assert isinstance(served, list) and served[-1]["status_code"] == 200
        key = f"{record['role']}_worker_id"
        assert str(served[-1][key]) == record["new_instance_id"]
        # Every stream in flight at the kill ended within the bound: served whole, or an error.
        streams = record["streams"]
        assert isinstance(streams, list) and len(streams) == 4
        in_flight = [s for s in streams if not s["before_kill"]]
        assert in_flight and all(s["outcome"] in ("served", "error") and s["ended_s"] < 10 for s in in_flight)
        # The survivors' gauges were back at once (nothing held for the dead peer), timed.
        assert isinstance(record["released_s"], float)
        probes = record["down_probes"]
        assert isinstance(probes, list) and all(p["request_s"] < 10 for p in probes), probes
        # The deployment was whole again before the next round: a run of requests in a row served, after the
        # router stopped sending some to the dead instance's entry (seen: a 503 0.7 s after the restart).
        assert isinstance(record["whole_s"], float) and record["whole_s"] < 60, record
    prefill_round, decode_round = rounds
    # A prefill's work is done by a stream's first token: the streams that had it were served whole by their
    # decodes (the kill comes once one stream is halfway: one still waiting may end with an error).
    assert isinstance(prefill_round["streams"], list)
    assert all(s["outcome"] == "served" for s in prefill_round["streams"] if s["tokens_at_kill"])
    # A dead decode's streams cut mid-answer end with an error event inside the 200 stream (migration limit 0):
    # 1.6.1 says 503 "Service temporarily unavailable", 1.4.2 and 1.5.1 "Internal server error". One still
    # waiting for its first token is refused outright (1.6.1: HTTP 503).
    assert isinstance(decode_round["streams"], list)
    cut = [s for s in decode_round["streams"] if s["tokens_at_kill"] and s["outcome"] == "error"]
    assert cut and all(s["status_code"] == 200 and s["error"] for s in cut), decode_round["streams"]
    waiting = [s for s in decode_round["streams"] if not s["before_kill"] and not s["tokens_at_kill"]]
    assert all(s["outcome"] == "error" for s in waiting), waiting
    if VERSION == "1.6.1":
        assert all("503" in str(s["error"]) for s in cut), cut
    if case.endswith("1p1d"):
        # No worker of the role left: a new request fails fast with an error, and no decode-only fallback serves
        # it without the dead prefill (1.6.1: 503 either way; 1.4.2 and 1.5.1: 500 without a prefill).
        for record in rounds:
            codes = [p["status_code"] for p in record["down_probes"]]  # type: ignore[union-attr]
            assert len(codes) == 1 and 500 <= codes[0] < 600, codes
            assert VERSION != "1.6.1" or codes == [503], codes
    else:
        # Round robin over two decodes: the survivor's streams were served whole.
        assert any(s["outcome"] == "served" for s in decode_round["streams"])
    assert_nothing_left(mocker, str(row["uid"]))


def _restarted(m: Matrix, case: str, runs_before: int) -> bool:
    """Whether the newest attempt of `case` (a new one) has started a killed worker again."""
    rows = m.sql('SELECT r.log_dir FROM cell_run r JOIN "case" c ON c.id = r.case_id WHERE c.name = ? '
                 "ORDER BY r.id", case)  # fmt: skip
    if len(rows) <= runs_before or not rows[-1][0]:
        return False
    log = Path(str(rows[-1][0])) / "prefill.log"
    return log.exists() and log.read_text(errors="replace").count("[matrix] starting prefill") >= 2


def test_a_runner_killed_during_peer_loss_leaves_nothing(mocker: Matrix) -> None:
    """kill -9 of `matrix run` once the peer-loss check has started a killed worker again: the cell's
    watchdog takes the frontend, the workers and the restarted one down."""
    case = PEER_LOSS[0]
    runs_before = len(mocker.sql('SELECT r.id FROM cell_run r JOIN "case" c ON c.id = r.case_id WHERE c.name = ?',
                                 case))  # fmt: skip
    runner = mocker.popen("run", "--runtime", f"dynamo={VERSION}", "--case", case, "--no-report")
    try:
        deadline = time.monotonic() + 300
        while not _restarted(mocker, case, runs_before):
            assert runner.poll() is None and time.monotonic() < deadline, "no worker was started again"
            time.sleep(0.2)
        listening = set()
        for proc in home_cell_processes(mocker.home):
            try:
                listening |= {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                continue
        alive = len(home_cell_processes(mocker.home))
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
        killed = time.monotonic()
        deadline = killed + 120
        while home_cell_processes(mocker.home) and time.monotonic() < deadline:  # the watchdog's work
            time.sleep(0.5)
        left = [(p.pid, p.name()) for p in home_cell_processes(mocker.home)]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for proc in home_cell_processes(mocker.home):
            proc.kill()
    assert alive >= 5, alive  # the frontend and four workers (one of them the restarted prefill) were up
    assert left == [], f"left after the runner's kill -9: {left}"
    (uid,) = mocker.sql('SELECT r.uid FROM cell_run r JOIN "case" c ON c.id = r.case_id WHERE c.name = ? '
                        "ORDER BY r.id DESC LIMIT 1", case)[0]  # fmt: skip
    held = sorted(listening)
    while held and time.monotonic() < deadline:
        held = [p for p in held if port_still_held(p, str(uid))]
        time.sleep(0.5)
    assert listening and not held, f"ports still held after the kill: {held}"
