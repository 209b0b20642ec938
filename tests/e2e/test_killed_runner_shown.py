"""[M21] item 4: a campaign whose runner was killed shows as interrupted everywhere, before any later run.

A runner is SIGKILLed while its pair hangs at start (a second cell waits, never started). Nothing has
recovered the rows yet (no later `matrix run`), so the database still says `running`; every reader must
say `interrupted`: `campaigns list` (status and counts) and the HTML report (campaign, grid, runtime page),
the pages read in a real Chromium.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.helpers.browser import open_tab, require_browser_here
from tests.helpers.cli import DATA, Matrix
from tests.helpers.processes import home_cell_processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANGING = """
[[runtime]]
backend = "reference"
version = "0.2.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.2.0" }

[[case]]
name = "hanging_pair"
backend = "reference"
arm = "reference"
model = "matrix-reference-tiny"
markers = ["e2e", "gpu_0"]
startup_timeout_s = 60
launch = { faults = ["hang-at-start"] }
"""


def test_a_killed_runner_shows_interrupted_in_the_list_and_the_report(matrix: Matrix) -> None:
    require_browser_here()
    extra = matrix.home / "hanging.toml"
    extra.write_text(HANGING)
    assert matrix("catalog", "sync", *map(str, sorted(DATA.glob("*.toml"))), str(extra)).exit_code == 0
    runner = matrix.popen("run", "--case", "hanging_pair", "-j", "1", "--no-report")
    try:
        deadline = time.monotonic() + 60
        while len(home_cell_processes(matrix.home)) < 3:
            assert runner.poll() is None and time.monotonic() < deadline, "the pair never started"
            time.sleep(0.1)
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
        deadline = time.monotonic() + 30
        while home_cell_processes(matrix.home) and time.monotonic() < deadline:  # the watchdog's work
            time.sleep(0.1)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for proc in home_cell_processes(matrix.home):
            proc.kill()
    assert sorted(s for (s,) in matrix.sql("SELECT status FROM cell_run")) == ["pending", "running"]

    listed = json.loads(matrix.subprocess("campaigns", "list", "--json").stdout)[0]
    assert listed["status"] == "interrupted"
    assert listed["outcomes"] == {"interrupted": 1, "pending": 1}, listed
    table = matrix.subprocess("campaigns", "list").stdout
    assert "running" not in table and "1 interrupted" in table, table

    out = matrix.home / "report"
    report = matrix.subprocess("report", "--out", str(out))
    assert report.returncode == 0, report.stderr
    # `matrix report` is a reader too: the rows stay `running` until a run recovers them.
    assert sorted(s for (s,) in matrix.sql("SELECT status FROM cell_run")) == ["pending", "running"]
    with open_tab() as tab:
        for page in ("index.html", "campaign-1.html", "runtime-reference-0.1.0.html", "runtime-reference-0.2.0.html"):
            load = tab.load((out / page).as_uri())
            assert load.errors == [], load.errors
            text = tab.evaluate("document.body.innerText")
            assert "RUNNING" not in text and "running" not in text.replace("running row", ""), (page, text)
        tab.load((out / "index.html").as_uri())
        assert "INTERRUPTED" in tab.evaluate("document.body.innerText")
