"""A skew pair that stops answering is cut and says who waited on what ([M20] item 2), on real processes.

The reference server's `kv-transfer-stall` fault makes prefill's side channel take decode's pull and never
answer, while decode and the frontend wait without a timeout of their own: the pair is healthy, the request
never ends. Run as a skew pair (two reference runtimes), matrix must cut it at the request's bound, record a
`timeout` whose message names the request in flight and, per role, each process's /proc state, wchan and last
log lines (decode's log says what it waits for), classify it `hang` with that evidence as the reason, and
leave nothing running.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import DATA, Matrix
from tests.helpers.processes import assert_nothing_left

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EXTRA = """
[[runtime]]
backend = "reference"
version = "0.1.1"
provider = { kind = "builtin" }
components = { matrix-reference = "0.1.0" }

[[case]]
name = "stalled_kv"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0", "e2e"]
startup_timeout_s = 30
request_timeout_s = 4
launch = { faults = ["kv-transfer-stall"] }
"""


@pytest.fixture(scope="module")
def stalled(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("hang")
    m = Matrix(home=home, db_path=home / "matrix.db")
    (home / "extra.toml").write_text(EXTRA)
    files = [str(DATA / n) for n in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")]
    assert m.subprocess("catalog", "sync", *files, str(home / "extra.toml")).returncode == 0
    result = m.subprocess("run", "--case", "stalled_kv", "--prefill-runtime", "reference=0.1.1",
                          "--decode-runtime", "reference=0.1.0", "--no-report", timeout=240)  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return m


def test_the_stalled_pair_is_cut_with_who_waited_on_what(stalled: Matrix) -> None:
    ((uid, status, kind, message, request_s),) = stalled.sql(
        "SELECT uid, status, failure_kind, message, request_s FROM cell_run"
    )
    assert (status, kind) == ("timeout", "request"), message
    text = str(message)
    print(text)  # the evidence, in the test's output
    # Cut at the bound (the case's 4 s, under the skew bound), not when something else gave up.
    assert 4.0 <= float(str(request_s)) < 30.0, request_s
    assert "no answer within 4 s after ready" in text and "matrix cut the pair" in text
    assert "request in flight: POST http://127.0.0.1:" in text and "/v1/chat/completions" in text
    for role in ("frontend:", "prefill:", "decode:"):
        assert f"\n{role}\n" in text, text
    # Every process is read from /proc while it still waits: the sleeping state and the kernel function.
    assert "state S (sleeping), wchan " in text and " threads: " in text, text
    # Prefill's own log says it took the pull and never answered; decode's last line is the pull it waits on.
    assert "stalled: never answering (fault kv-transfer-stall)" in text, text
    decode_part = text.split("\ndecode:\n", 1)[1].split("\nfrontend:\n", 1)[0]
    assert decode_part.rstrip().splitlines()[-1].split("] ", 1)[1].startswith("decode handle="), decode_part
    assert "pulling" in decode_part.rstrip().splitlines()[-1], decode_part
    # It had not given up when matrix read it (at teardown prefill's exit may close the channel first, and
    # decode then logs a failed pull, after the evidence was taken).
    assert "KV transfer failed" not in decode_part, decode_part
    assert_nothing_left(stalled, str(uid))


def test_the_skew_grid_calls_it_a_hang_with_the_evidence_as_its_reason(stalled: Matrix) -> None:
    result = stalled("skew", "stalled_kv", "--json")
    assert result.exit_code == 0, result.output
    (cell,) = json.loads(result.output)["cells"]
    assert (cell["prefill"], cell["decode"], cell["class"]) == ("0.1.1", "0.1.0", "hang"), cell
    assert "who waited on what" in cell["reason"] and "decode:" in cell["reason"], cell["reason"]
