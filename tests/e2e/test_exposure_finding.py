"""[M29] item 7: a `--loopback-only` failure is an exposure, its own finding, on real reference pairs.

Two reference releases whose prefill listens on 0.0.0.0 (fault `listen-everywhere`). The previous release
ran without the flag (it passed, its exposure said in the message); the candidate and both skew orders ran
with `--loopback-only` and failed only that check. The gate must call that `exposure`, not a regression
against the previous release (which exposed the same), and the skew rule must not call the pairs
`healthy-but-wrong`; the skew grid, `matrix show` (text) and the report's index name it `exposed`.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import DATA, Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

EXTRA = """
[[runtime]]
backend = "reference"
version = "0.2.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.1.0" }

[[case]]
name = "exposed_pair"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e"]
startup_timeout_s = 30
request_timeout_s = 10
launch = { faults = ["listen-everywhere"], lifecycle = false }

[[gate]]
name = "upgrade"
expression = "e2e"
rules = { skew_both_ways = true }
"""


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("exposure")
    m = Matrix(home=home, db_path=home / "matrix.db")
    (home / "extra.toml").write_text(EXTRA)
    files = [str(DATA / n) for n in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")]
    assert m.subprocess("catalog", "sync", *files, str(home / "extra.toml")).returncode == 0
    runs = [
        (0, ["--runtime", "reference=0.1.0"]),  # the previous release, judged without the flag: passes
        (1, ["--runtime", "reference=0.2.0", "--loopback-only"]),
        (1, ["--prefill-runtime", "reference=0.2.0", "--decode-runtime", "reference=0.1.0", "--loopback-only"]),
        (1, ["--prefill-runtime", "reference=0.1.0", "--decode-runtime", "reference=0.2.0", "--loopback-only"]),
    ]
    for code, args in runs:
        result = m.subprocess("run", "--case", "exposed_pair", *args, "--no-report", "-q", timeout=240)
        assert result.returncode == code, (args, result.stdout[-3000:] + result.stderr[-3000:])
    return m


def test_the_gate_calls_it_exposure_not_a_regression_nor_a_wrong_answer(exposed: Matrix) -> None:
    result = exposed("gate", "reference", "0.2.0", "--policy", "upgrade", "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert data["verdict"] == "NO-GO" and data["previous_release"] == "0.1.0"
    kinds = [(r["kind"], r["blocking"]) for r in data["reasons"]]
    assert ("regression", True) not in kinds and ("failed", True) not in kinds, kinds
    exposure = [r for r in data["reasons"] if r["kind"] == "exposure"]
    # The cell itself and both skew orders: each an exposure finding, blocking.
    assert len(exposure) == 3 and all(r["blocking"] for r in exposure), exposure
    assert all("0.0.0.0:" in r["message"] for r in exposure), exposure
    assert not any(r["kind"] == "skew" for r in data["reasons"]), data["reasons"]
    assert "healthy-but-wrong" not in result.output
    text = exposed("gate", "reference", "0.2.0", "--policy", "upgrade")
    assert "exposure" in text.output and "not a regression" in text.output, text.output


def test_the_skew_grid_classes_the_pairs_exposed(exposed: Matrix) -> None:
    result = exposed("skew", "exposed_pair", "--json")
    assert result.exit_code == 0, result.output
    classes = {(e["prefill"], e["decode"]): e["class"] for e in json.loads(result.output)["cells"]}
    assert classes[("0.2.0", "0.1.0")] == "exposed" and classes[("0.1.0", "0.2.0")] == "exposed", classes


def test_show_and_the_index_name_the_exposure(exposed: Matrix) -> None:
    shown = exposed("show", "exposed_pair@reference-0.2.0")
    assert shown.exit_code == 0, shown.output
    status = next(line for line in shown.output.splitlines() if line.startswith("status"))
    assert "EXPOSED" in status and "0.0.0.0:" in status, shown.output
    assert any(line.startswith("listens on") and "0.0.0.0:" in line for line in shown.output.splitlines())
    report = exposed.home / "report"
    assert exposed("report", "--out", str(report)).exit_code == 0
    index = (report / "index.html").read_text()
    assert "EXPOSED" in index and "st-exposed" in index
