"""[M15] Numbers with confidence, on real reference pairs through the real CLI.

* A planted slowdown (`slow-request`, +15 % request latency) on one runtime: `matrix run --repeat 30` on
  both, and `matrix compare` flags request time as a regression at p < 0.01; the gate's `max_slowdown`
  rule blocks on it.
* A planted 30 % flake (`flaky-start`): the pass rate and its Wilson interval show in `show`, compare and
  the exports; a gate with `min_pass_rate = 0.95` is INCOMPLETE at N = 3 and NO-GO with enough samples.
* The KV ledger of every passed attempt is filled by the ordinary run path (decode's counters).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.confidence import run, runtime, setup_catalog

pytestmark = pytest.mark.e2e

def test_planted_slowdown_is_flagged_and_blocks_the_gate(matrix: Matrix) -> None:
    # +60 %, not the acceptance's +15 %: at N = 30 a side +15 % is flagged in 94 of 100 trials
    # (tests/bench/bench_statistics.py, docs/statistics.md), so a suite test of it would fail about once in
    # twenty runs for no fault of the code. The code path is the same; the bench measures the power.
    slow = 'MATRIX_REFERENCE_FAULTS = "slow-request", MATRIX_REFERENCE_SLOWDOWN = "0.6"'
    setup_catalog(matrix, runtime("1.0.0") + runtime("1.1.0", slow))
    # One cell at a time: no other pair starting beside the timed request.
    run(matrix, "1.0.0", "1.1.0", repeat=30, jobs=1)
    result = matrix("compare", "synth=1.0.0", "synth=1.1.0", "--json")
    assert result.exit_code == 0, result.output
    case = json.loads(result.output)["cases"][0]
    request = next(m for m in case["performance"] if m["metric"] == "request_s")
    assert request["n_a"] == 30 and request["n_b"] == 30
    assert request["p_value"] < 0.01, request
    assert 1.2 < request["ratio"] < 2.5 and request["ratio_low"] > 1.0, request
    assert "request_s" in case["regressions"]
    # The ledger came from the ordinary run path: every passed attempt has decode's transfer.
    assert any(m["metric"] == "kv_bytes" for m in case["performance"])
    text = matrix("compare", "synth=1.0.0", "synth=1.1.0")
    assert "request_s x1." in text.output and "REGRESSION" in text.output
    gate = matrix("gate", "synth", "1.1.0", "--policy", "speed")
    assert gate.exit_code == 1, gate.output
    assert "slowdown" in gate.output and "request_s" in gate.output
    # The same comparison with a threshold above the planted change does not flag request time: significance
    # alone is not a regression. (Other metrics are not asserted: ready time and the microsecond KV copy
    # follow the host's load, which differs between the two runs on a shared machine.)
    lenient = json.loads(matrix("compare", "synth=1.0.0", "synth=1.1.0", "--json", "--threshold", "3").output)
    assert "request_s" not in lenient["cases"][0]["regressions"]
    html = matrix.home / "compare.html"
    assert matrix("compare", "synth=1.0.0", "synth=1.1.0", "--html", str(html)).exit_code == 0
    page = html.read_text()
    assert "Mann&ndash;Whitney" in page and "REGRESSION" in page and "request_s x1." in page


def test_planted_flake_is_incomplete_at_three_and_no_go_with_enough_samples(matrix: Matrix) -> None:
    flaky = 'MATRIX_REFERENCE_FAULTS = "flaky-start", MATRIX_REFERENCE_FLAKE_RATE = "0.3"'
    setup_catalog(matrix, runtime("1.0.0") + runtime("2.0.0", flaky))
    run(matrix, "2.0.0", repeat=3)
    gate = matrix("gate", "synth", "2.0.0", "--policy", "flake")
    assert gate.exit_code == 3, gate.output  # INCOMPLETE: 3 samples are fewer than min_samples
    assert gate.output.startswith("INCOMPLETE") and "few-samples" in gate.output
    run(matrix, "2.0.0", repeat=57)
    gate = matrix("gate", "synth", "2.0.0", "--policy", "flake", "--json")
    verdict = json.loads(gate.output)
    rate = verdict["cells"][0]["pass_rate"]
    assert rate["samples"] == 60 and rate["failed"] > 0, rate
    # 30 % planted: NO-GO needs 7 or more failures of 60 (Wilson upper bound below 0.95); P(fewer) = 0.0002.
    assert rate["wilson_high"] < 0.95, rate
    assert verdict["verdict"] == "NO-GO" and gate.exit_code == 1
    assert any(r["kind"] == "low-pass-rate" for r in verdict["reasons"])
    show = json.loads(matrix("show", "ref_timed@synth-2.0.0", "--json").output)
    assert show["pass_rate"]["samples"] == 60 and show["pass_rate"]["flaky"] is True
    exported = list(csv.DictReader(io.StringIO(matrix("export", "csv", "--runtime", "synth=2.0.0").output)))
    assert exported[0]["samples"] == "60" and exported[0]["flaky"] == "True"
    assert float(exported[0]["wilson_low"]) < float(exported[0]["pass_rate"]) < float(exported[0]["wilson_high"])
    cells = json.loads(matrix("export", "json", "--runtime", "synth=2.0.0").output)["cells"]
    assert cells[0]["pass_rate"]["samples"] == 60
    report = matrix("report", "--out", str(matrix.home / "report"))
    assert report.exit_code == 0, report.output
    grid = (matrix.home / "report" / "index.html").read_text()
    assert "pass " in grid and "95 % CI" in grid and "history " in grid


def test_a_passed_reference_attempt_has_a_kv_ledger(matrix: Matrix) -> None:
    setup_catalog(matrix, runtime("1.0.0"))
    run(matrix, "1.0.0", repeat=1)
    shown = json.loads(matrix("show", "ref_timed@synth-1.0.0", "--json").output)
    ledger = shown["kv_ledger"]
    assert ledger["transfers"] == 1 and ledger["bytes"] > 0 and ledger["seconds"] > 0, ledger
    assert ledger["gb_per_s"] > 0 and ledger["source"].startswith("reference at http://127.0.0.1:")
    assert Path(shown["log_dir"], "metrics-decode.prom").is_file()
