"""A skew pair that refuses itself in its KV handshake is a clean-reject by where it was raised, and a skew run
whose grid holds only honest refusals exits 0 ([M29] items 10 and 12), on real processes.

The reference server's `kv-handshake-refusal` fault makes decode's transfer set-up raise vLLM's block-size
`AssertionError: Local block size 32 is not divisible by remote block size 64 or vice versa.` from its
`add_remote_agent`, log the traceback line by line and answer 500, staying up: no word of an incompatibility
list is in it. Run as a skew pair of two reference runtimes, matrix must class it `clean-reject` quoting that
line, print it as such (never FAILED), end the run with the grid, and exit 0; the same run with a pair that
answers an error it cannot explain (`kv-transfer-dropped`) exits 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import DATA, Matrix
from tests.helpers.processes import assert_nothing_left

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCKS = "AssertionError: Local block size 32 is not divisible by remote block size 64 or vice versa."
EXTRA = """
[[runtime]]
backend = "reference"
version = "0.1.1"
provider = { kind = "builtin" }
components = { matrix-reference = "0.1.0" }

[[case]]
name = "handshake_refusal"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e"]
startup_timeout_s = 30
request_timeout_s = 20
launch = { faults = ["kv-handshake-refusal"], lifecycle = false }

[[case]]
name = "transfer_dropped"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e"]
startup_timeout_s = 30
request_timeout_s = 20
launch = { faults = ["kv-transfer-dropped"], lifecycle = false }
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("refusal")
    m = Matrix(home=home, db_path=home / "matrix.db")
    (home / "extra.toml").write_text(EXTRA)
    files = [str(DATA / n) for n in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")]
    assert m.subprocess("catalog", "sync", *files, str(home / "extra.toml")).returncode == 0
    return m


def _pair(m: Matrix, case: str) -> tuple[int, str]:
    result = m.subprocess("run", "--case", case, "--prefill-runtime", "reference=0.1.1", "--decode-runtime",
                          "reference=0.1.0", "--no-report", timeout=240)  # fmt: skip
    return result.returncode, result.stdout + result.stderr


def test_a_refusal_raised_in_the_handshake_is_a_clean_reject_and_the_run_exits_0(home: Matrix) -> None:
    code, output = _pair(home, "handshake_refusal")
    print(output)
    assert code == 0, output  # an honest refusal is what a skew grid may say, not a failure of the run
    assert "CLEAN-REJECT" in output and "\nFAILED " not in output and not output.startswith("FAILED"), output
    # The run ends with its grid: rows prefill, columns decode, the class in the cell and the quoted reason.
    assert "handshake_refusal (reference): rows prefill, columns decode" in output, output
    assert "skew pairs: 1 clean-reject" in output, output
    ((uid, status, exit_codes),) = home.sql("SELECT uid, status, exit_codes FROM cell_run")
    assert status == "failed"
    codes = exit_codes if isinstance(exit_codes, dict) else json.loads(str(exit_codes))
    assert codes.get("decode") in (0, -15), codes  # decode stayed up and was stopped at teardown
    result = home("skew", "handshake_refusal", "--json")
    (cell,) = json.loads(result.output)["cells"]
    assert cell["class"] == "clean-reject", cell
    assert cell["reason"].startswith(BLOCKS) and "add_remote_agent" in cell["reason"], cell["reason"]
    assert_nothing_left(home, str(uid))


def test_an_unexplained_error_answer_still_fails_the_run(home: Matrix) -> None:
    code, output = _pair(home, "transfer_dropped")
    assert code == 1, output
    assert "ERROR-ANSWER" in output and "transfer_dropped (reference): rows prefill, columns decode" in output


def test_the_report_page_has_no_frontend_column_without_a_frontend_axis(home: Matrix, tmp_path: Path) -> None:
    assert home("report", "--out", str(tmp_path)).exit_code == 0
    page = (tmp_path / "skew-handshake_refusal.html").read_text(encoding="utf-8")
    assert "<th>frontend</th>" not in page and BLOCKS in page
