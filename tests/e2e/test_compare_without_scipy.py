"""[M29] item 6: without scipy, `matrix compare` never calls a slowdown "unchanged".

Real reference pairs (a planted `slow-request` fault on one runtime, the repeats interleaved in one
campaign), then `matrix compare` in a process where scipy cannot be imported (the README's base install):
the case is `slower (not tested)` and `--fail-on regression` exits 1. The same data with scipy is `slower`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.confidence import run, runtime, setup_catalog

pytestmark = pytest.mark.e2e

# `python -m matrix` with scipy made unimportable first: `import scipy` raises ImportError, as on a host
# without the [stats] extra.
WITHOUT_SCIPY = (
    "import runpy, sys; sys.modules['scipy'] = None; sys.modules['scipy.stats'] = None; "
    "runpy.run_module('matrix', run_name='__main__', alter_sys=True)"
)


def compare_without_scipy(m: Matrix, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_SCIPY, "compare", *args], env=m.env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


def test_a_planted_slowdown_without_scipy_is_slower_not_tested_and_fails_ci(matrix: Matrix) -> None:
    slow = 'MATRIX_REFERENCE_FAULTS = "slow-request", MATRIX_REFERENCE_SLOWDOWN = "1.0"'
    setup_catalog(matrix, runtime("1.0.0") + runtime("1.0.1") + runtime("1.1.0", slow))
    run(matrix, "1.0.0", "1.0.1", "1.1.0", repeat=5, jobs=1)

    base = compare_without_scipy(matrix, "synth=1.0.0", "synth=1.1.0", "--json", "--fail-on", "regression")
    data = json.loads(base.stdout)
    assert data["significance_tested"] is False
    case = data["cases"][0]
    request = next(m for m in case["performance"] if m["metric"] == "request_s")
    assert request["p_value"] is None and request["ratio_low"] > 1.10, request  # the whole interval is past 10 %
    assert case["verdict"] == "slower (not tested)", case
    assert base.returncode == 1, base.stderr

    text = compare_without_scipy(matrix, "synth=1.0.0", "synth=1.1.0", "--fail-on", "regression")
    assert text.returncode == 1
    assert "ref_timed (slower (not tested))" in text.stdout and "SLOWER (not tested)" in text.stdout, text.stdout
    assert "unchanged" not in text.stdout.split("significance not tested")[0]

    # Identical runtimes: without the test nothing may be called unchanged either.
    same = json.loads(compare_without_scipy(matrix, "synth=1.0.0", "synth=1.0.1", "--json").stdout)
    assert same["cases"][0]["verdict"] in ("insufficient data", "slower (not tested)"), same["cases"][0]

    # With scipy, the same samples are a tested slowdown.
    tested = matrix("compare", "synth=1.0.0", "synth=1.1.0", "--json", "--fail-on", "regression")
    assert tested.exit_code == 1 and json.loads(tested.output)["cases"][0]["verdict"] == "slower"
