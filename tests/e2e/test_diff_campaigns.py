"""[M30] item 5: `matrix diff` on two real campaigns of the reference server, and the report's "since the last
campaign" page.

The catalog is synced twice with planted faults (`matrix.reference.faults`) moved between the syncs, each sync
followed by a campaign on two reference runtimes:

* `turns_bad`: healthy, then `crash-at-start`: a new failure on both runtimes, its exit code normalised;
* `gets_fixed`: `empty-completion`, then healthy: fixed;
* `stays_bad`: `missing-usage` in both: still failing, one signature with both runtimes' cells as members;
* `timed`: healthy, then `slow-request` (+100 % request time), eight repeats a campaign: newly slow (with
  five, one sample out of order on a loaded host left the rank test short of significance: insufficient data);
* `dropped`: healthy, left out of the second campaign: not run.

A third campaign runs `timed` once: against the second, one sample a side is 'insufficient data', not unchanged.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.cli import DATA, Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RUNTIMES = """
[[runtime]]
backend = "reference"
version = "0.1.0"
provider = { kind = "builtin", env = { MATRIX_REFERENCE_SLOWDOWN = "1.0" } }
components = { matrix-reference = "0.1.0" }

[[runtime]]
backend = "reference"
version = "0.2.0"
provider = { kind = "builtin", env = { MATRIX_REFERENCE_SLOWDOWN = "1.0" } }
components = { matrix-reference = "0.2.0" }
"""


def case(name: str, faults: tuple[str, ...] = (), extra: str = "") -> str:
    listed = ", ".join(f'"{f}"' for f in faults)
    return f"""
[[case]]
name = "{name}"
backend = "reference"
arm = "reference"
model = "tiny"
markers = ["gpu_0"]
startup_timeout_s = 20
request_timeout_s = 10
launch = {{ lifecycle = false, faults = [{listed}]{extra} }}
"""


# 16 tokens at 10 ms each: a request long enough that the planted slowdown stands above the host's jitter.
TIMED = ", token_delay_ms = 10"


def catalog(first: bool) -> str:
    return RUNTIMES + "".join((
        case("turns_bad", () if first else ("crash-at-start",)),
        case("gets_fixed", ("empty-completion",) if first else ()),
        case("stays_bad", ("missing-usage",)),
        case("timed", () if first else ("slow-request",), TIMED),
        case("dropped"),
    ))  # fmt: skip


def sync(m: Matrix, text: str) -> None:
    path = m.home / "catalog.toml"
    path.write_text(text)
    synced = m("catalog", "sync", str(DATA / "backends.toml"), str(DATA / "markers.toml"), str(path))
    assert synced.exit_code == 0, synced.output


def run(m: Matrix, *args: str) -> str:
    done = m.subprocess("run", "--backend", "reference", "--max-attempts", "1", "-j", "2", "-q", *args, timeout=400)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return done.stdout


def test_matrix_diff_of_two_real_campaigns(matrix: Matrix) -> None:
    sync(matrix, catalog(first=True))
    run(matrix, "--repeat", "8", "--no-report")
    sync(matrix, catalog(first=False))
    cases = ("turns_bad", "gets_fixed", "stays_bad", "timed")
    run(matrix, "--repeat", "8", *(arg for name in cases for arg in ("--case", name)))

    result = matrix("diff", "1", "2", "--json", "--alpha", "0.05")
    assert result.exit_code == 1, result.output  # new failures, the default --fail-on
    data = json.loads(result.output)
    assert data["failing"] == ["new failures"]
    # Both runtimes' crash. Which worker exits first is a race, and "decode exited" and "prefill exited" are
    # different first lines, so the two cells are one group or two; the exit code is normalised either way.
    groups = data["new_failures"]
    assert 1 <= len(groups) <= 2 and sum(g["cells"] for g in groups) == 2, groups
    members = [m for g in groups for m in g["members"]]
    assert {(m["case"], m["runtime"]) for m in members} == {("turns_bad", "reference-0.1.0"),
                                                            ("turns_bad", "reference-0.2.0")}  # fmt: skip
    for group in groups:
        assert re.fullmatch(r"startup: (prefill|decode) exited with code <n> before it was ready",
                            group["signature"]), group["signature"]  # fmt: skip
    assert all(m["a"]["status"] == "passed" and m["b"]["status"] == "failed" for m in members)
    # A grouped signature: both runtimes' failures of `stays_bad` read as one line with two members.
    [still] = data["still_failing"]
    assert {m["case"] for m in still["members"]} == {"stays_bad"} and still["cells"] == 2, still
    assert still["signature"] == "validation: failed checks: usage_object", still
    assert {(m["case"], m["runtime"]) for m in data["fixed"]} == {("gets_fixed", "reference-0.1.0"),
                                                                  ("gets_fixed", "reference-0.2.0")}  # fmt: skip
    assert {m["case"] for m in data["newly_slow"]} == {"timed"}, data["newly_slow"]
    assert all("request_s" in m["note"] and "REGRESSION" in m["note"] for m in data["newly_slow"])
    assert {m["case"] for m in data["not_run"]} == {"dropped"} and len(data["not_run"]) == 2
    assert data["counts"] == {"new failures": 2, "still failing": 2, "fixed": 2, "newly slow": 2, "not run": 2}

    text = matrix("diff", "last~1", "last", "--alpha", "0.05")
    assert text.exit_code == 1
    assert f"new failures (2 cells, {len(groups)} signatures):" in text.output, text.output
    assert "  [2] validation: failed checks: usage_object" in text.output, text.output
    assert "      turns_bad@reference-0.1.0 (was passed)" in text.output
    assert "      stays_bad@reference-0.2.0 (was failed)" in text.output
    assert "--fail-on new: 2 new failures" in text.output
    assert matrix("diff", "1", "2", "--fail-on", "never").exit_code == 0

    # The report the second run wrote links the page, which says the same.
    report = matrix.home / "report"
    index = (report / "index.html").read_text()
    assert 'href="since-last.html"' in index and "campaign 1 -&gt; campaign 2" in index
    page = (report / "since-last.html").read_text()
    for heading in (f"new failures (2 cells, {len(groups)} signatures)", "still failing (2 cells, 1 signatures)",
                    "fixed (2)", "newly slow (2)", "not run (2)"):  # fmt: skip
        assert heading in page, heading

    # One run a side cannot say a cell did not get slower. The run refreshes the report (same catalog: only
    # the pages it reaches), and the page of the newest campaign is one of them.
    assert "pages refreshed" in run(matrix, "--case", "timed", "--runtime", "reference=0.2.0")
    assert "campaign 2 -&gt; campaign 3" in (report / "index.html").read_text()
    assert "Since the last campaign: campaign 2 &rarr; campaign 3" in (report / "since-last.html").read_text()
    third = json.loads(matrix("diff", "last~1", "last", "--json").output)
    assert [(m["case"], m["runtime"]) for m in third["insufficient_data"]] == [("timed", "reference-0.2.0")]
    assert third["counts"].get("unchanged") is None and third["newly_slow"] == []


@pytest.mark.parametrize("spec", ["99", "last~5", "yesterday"])
def test_an_unknown_campaign_is_one_line_and_exit_2(matrix: Matrix, spec: str) -> None:
    result = matrix("diff", spec, "last")
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "campaign" in result.output
