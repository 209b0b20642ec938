"""The oracle's aggregated answers kept for a campaign (`matrix.check.baselines`) on real reference pairs: the
first attempt of a case starts its aggregated instance, a later attempt with the very same instance plan reuses
those answers and starts none, and a reused baseline still catches KV corrupted after its checksum. A case
whose aggregated instance differs (the faulty case's environment names its fault) never gets another case's
answers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from matrix.check import oracle
from matrix.check.baselines import Baseline, OracleBaselines
from tests.helpers.oracle import run_oracle_cells
from tests.helpers.processes import cell_processes, port_still_held

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _document(home: Path, name: str) -> dict[str, object]:
    return dict(json.loads((home / "runs" / name / "equivalence.json").read_text()))


def test_a_later_attempt_reuses_the_aggregated_answers_and_still_catches_corrupt_kv(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MATRIX_HOME", str(tmp_path))
        runs = run_oracle_cells(tmp_path, 2, OracleBaselines())
    by_name = {f"{r.case}-{i}": r for i, r in ((n // 2, r) for n, r in enumerate(runs))}
    for case in ("oracle_clean", "oracle_kv_corrupt"):
        first, second = by_name[f"{case}-0"], by_name[f"{case}-1"]
        made, reused = _document(tmp_path, f"{case}-0"), _document(tmp_path, f"{case}-1")
        assert made["aggregated_reused_from"] is None
        assert reused["aggregated_reused_from"] == f"oracle-{case}-0"  # the faulty case's own, not the clean one's
        assert reused["aggregated_s"] == made["aggregated_s"]
        # Only the first attempt started an aggregated deployment (its logs and its three ports).
        assert (tmp_path / "runs" / f"{case}-0" / "aggregated.log").is_file()
        assert not (tmp_path / "runs" / f"{case}-1" / "aggregated.log").exists()
        assert (len(first.ports), len(second.ports)) == (8, 5)
        assert f"aggregated answers of oracle-{case}-0 reused" in second.message
        assert not any(
            port_still_held(p, f"oracle-{case}-0", f"oracle-{case}-1") for p in (*first.ports, *second.ports)
        )
        for i in range(2):
            assert cell_processes(f"oracle-{case}-{i}") == []
    assert (by_name["oracle_clean-1"].status, by_name["oracle_clean-1"].identical) == ("passed", 16)
    corrupt = by_name["oracle_kv_corrupt-1"]
    assert (corrupt.status, corrupt.failed_checks, corrupt.identical) == ("failed", ("equivalent_to_aggregated",), 0)


def test_one_make_per_key_and_a_failed_make_stores_nothing() -> None:
    store = OracleBaselines()
    calls: list[str] = []
    gate = threading.Event()

    def make() -> Baseline:
        calls.append("made")
        gate.wait(5)
        return Baseline(("a",), "cell-1", 1.0, 0.5)

    results: list[tuple[Baseline | None, bool]] = []
    threads = [threading.Thread(target=lambda: results.append(store.get_or_make("k", make))) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # the other two are waiting for the first make, not making their own
    gate.set()
    for thread in threads:
        thread.join(5)
    assert calls == ["made"] and sorted(reused for _b, reused in results) == [False, True, True]
    assert store.get_or_make("other", lambda: None) == (None, False)
    again = store.get_or_make("other", lambda: Baseline((), "cell-2", 2.0, None))
    assert again == (Baseline((), "cell-2", 2.0, None), False)  # the failure was not kept


def test_only_a_baseline_with_every_prompt_answered_is_kept() -> None:
    answered = oracle.Completion(token_ids=(1,), top=(((1, -0.1),),), text="x")
    assert Baseline((answered, answered), "c", 1.0, 0.5).complete
    assert not Baseline((answered, "timed out after 60 s"), "c", 1.0, 0.5).complete
