"""[M29] item 5 on real processes: a runner SIGTERMed mid-cell leaves an `interrupted` attempt, and that
attempt replaces no evidence.

Two reference releases, the newer one with a planted slowdown (+100 % request time), five passed repeats a
side in one campaign; then a third `matrix run` of the baseline is SIGTERMed while its pair starts. Before,
`compare` read the baseline as `interrupted` (a failure), called the slowdown `fixed` and `--fail-on
regression` exited 0; the gate read the interruption as the baseline's failure. Now both stand on the passes.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.confidence import run, runtime, setup_catalog

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def _sigterm_while_running(m: Matrix, spec: str) -> None:
    before = m.sql("SELECT count(*) FROM cell_run")[0][0]
    runner = m.popen("run", "--runtime", spec, "--no-report", "-q", "-j", "1")
    try:
        deadline = time.monotonic() + 60
        while not m.sql("SELECT count(*) FROM cell_run WHERE status = 'running' AND id > ?", before)[0][0]:
            assert runner.poll() is None and time.monotonic() < deadline, "the cell never started"
            time.sleep(0.05)
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=120) == 3  # interrupted
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()


def test_a_sigtermed_baseline_run_does_not_turn_a_slowdown_into_fixed(matrix: Matrix) -> None:
    slow = 'MATRIX_REFERENCE_FAULTS = "slow-request", MATRIX_REFERENCE_SLOWDOWN = "1.0"'
    setup_catalog(matrix, runtime("1.0.0") + runtime("1.1.0", slow))
    run(matrix, "1.0.0", "1.1.0", repeat=5, jobs=1)
    _sigterm_while_running(matrix, "synth=1.0.0")
    statuses = [s for (s,) in matrix.sql("SELECT status FROM cell_run ORDER BY id")]
    assert statuses[-1] == "interrupted" and statuses.count("passed") == 10, statuses

    result = matrix("compare", "synth=1.0.0", "synth=1.1.0", "--json", "--fail-on", "regression")
    case = json.loads(result.output)["cases"][0]
    assert case["a"]["status"] == "passed" and case["verdict"] == "slower", case
    assert result.exit_code == 1

    speed = matrix("gate", "synth", "1.1.0", "--policy", "speed", "--json")
    data = json.loads(speed.output)
    assert data["cells"][0]["previous"] == "passed", data["cells"]  # the baseline stands on its last pass
    assert speed.exit_code == 1 and any(r["kind"] == "slowdown" for r in data["reasons"]), data["reasons"]
