"""`matrix plan --makespan`: the scheduler's own rules replayed on the cases' earlier attempts ([M31] item 3).

Before any run every cell counts its timeouts; after a real `matrix run` of the reference pairs every cell the
host can run has a history, and the prediction lies between the slowest cell and the cells one after another.
"""

from __future__ import annotations

import json

from tests.helpers.cli import Matrix


def _forecast(m: Matrix, *args: str) -> dict[str, object]:
    result = m("plan", "--backend", "reference", "--makespan", "--json", *args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    forecast: dict[str, object] = document["makespan"]
    assert forecast["cells"] + forecast["cannot_run"] == len(document["cells"])  # type: ignore[operator]
    return forecast


def test_the_forecast_replays_earlier_attempts_and_says_what_it_rests_on(seeded: Matrix) -> None:
    before = _forecast(seeded)
    assert before["from_history"] == 0 and before["cells"] > 0
    text = seeded("plan", "--backend", "reference", "--makespan").output
    assert f"{before['cells']} without an earlier attempt count their timeouts" in text
    assert "predicted makespan on this host:" in text

    ran = seeded.subprocess("run", "--backend", "reference", "--no-report", timeout=240)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    after = _forecast(seeded)
    assert after["from_history"] == after["cells"] == before["cells"]
    assert after["slowest_s"] <= after["makespan_s"] <= after["sum_s"]  # type: ignore[operator]
    # The medians of real attempts, not the cases' timeouts (tens of seconds each).
    assert after["sum_s"] < before["sum_s"]  # type: ignore[operator]
    # One cell at a time is the sum of the cells.
    serial = _forecast(seeded, "-j", "1")
    assert serial["workers"] == 1 and abs(serial["makespan_s"] - serial["sum_s"]) < 1e-6  # type: ignore[operator]


def test_runs_scheduling_options_need_makespan_in_plan(seeded: Matrix) -> None:
    for args, message in ((("--pack",), "go with --makespan"), (("--makespan", "-j", "0"), "at least 1"),
                          (("--makespan", "--format", "github-matrix"), "table or json")):  # fmt: skip
        result = seeded("plan", *args)
        assert result.exit_code == 2 and message in result.output, result.output
