"""The equivalence oracle on real reference pairs: a small version of the 50-run acceptance
(tests/bench/bench_equivalence_oracle.py). KV corrupted after its checksum passes every other check and
fails exactly `equivalent_to_aggregated`; a healthy pair never fails it; the aggregated instance leaves no
process and no port behind, and its per-prompt results are in the cell's log directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.oracle import run_oracle_cells
from tests.helpers.processes import cell_processes, port_still_held

RUNS = 2


@pytest.fixture(scope="module")
def oracle_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:  # type: ignore[type-arg]
    home = tmp_path_factory.mktemp("oracle")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MATRIX_HOME", str(home))
        return home, run_oracle_cells(home, RUNS)


def test_kv_corrupted_after_the_checksum_fails_only_the_oracle(oracle_runs: tuple[Path, list]) -> None:  # type: ignore[type-arg]
    home, runs = oracle_runs
    corrupt = [r for r in runs if r.case == "oracle_kv_corrupt"]
    assert len(corrupt) == RUNS
    for run in corrupt:
        assert (run.status, run.failed_checks) == ("failed", ("equivalent_to_aggregated",)), run.message
        assert run.identical == 0 and run.prompts == 16
    document = json.loads((home / "runs" / "oracle_kv_corrupt-0" / "equivalence.json").read_text())
    first = document["results"][0]
    assert first["kind"] == "divergence" and first["divergence_at"] == 0 and first["gap"] >= 2.0
    assert len(first["pd_token_ids"]) == len(first["aggregated_token_ids"]) == 64
    assert document["aggregated_s"] > 0 and document["tokens"] == 64


def test_a_healthy_pair_is_token_identical_to_aggregated(oracle_runs: tuple[Path, list]) -> None:  # type: ignore[type-arg]
    home, runs = oracle_runs
    clean = [r for r in runs if r.case == "oracle_clean"]
    for run in clean:
        assert run.status == "passed", run.message
        assert run.identical == run.prompts == 16
        assert "16/16 prompts token-identical to aggregated" in run.message and "aggregated instance" in run.message
    # The aggregated instance's processes and ports went like the pair's.
    for run in runs:
        assert len(run.ports) == 8  # five of the pair, three of the aggregated deployment
        assert not any(
            port_still_held(p, *(f"oracle-{r.case}-{i}" for r in runs for i in range(RUNS))) for p in run.ports
        )
    for i in range(RUNS):
        assert cell_processes(f"oracle-oracle_clean-{i}") == []
        logs = {p.name for p in (home / "runs" / f"oracle_clean-{i}").iterdir()}
        assert {"aggregated.log", "aggregated_frontend.log", "decode.log", "equivalence.json"} <= logs
