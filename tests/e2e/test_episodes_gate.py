"""[M30] item 1: the gate names the open failure episodes of the cells it requires (text and JSON), and stops
naming one once a pass of the same cell closed it. Real reference campaigns."""

from __future__ import annotations

import json

import pytest

from tests.helpers import toggled_cells as toggled
from tests.helpers.cli import Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

GATE = """
[[gate]]
name = "ep_gate"
expression = "gpu_0"
"""


def _sync(m: Matrix, *, broken: bool) -> None:
    toggled.sync(m, toggled.case("ref_episode", broken=broken), GATE)


def test_the_gate_names_an_open_episode_until_a_pass_closes_it(matrix: Matrix) -> None:
    _sync(matrix, broken=False)
    assert matrix.subprocess("run", "--no-report", "-q").returncode == 0
    _sync(matrix, broken=True)
    for _ in range(2):  # a repeat keeps the one episode open
        assert matrix.subprocess("run", "--no-report", "-q").returncode == 1
    text = matrix("gate", "reference", "0.1.0", "--policy", "ep_gate")
    assert text.exit_code == 1, text.output
    lines = text.output.splitlines()
    at = lines.index("open episodes: 1 (matrix episodes --open)")
    assert lines[at + 1].startswith("  ref_episode @ reference-0.1.0: validation, usage_object; open for ")
    assert lines[at + 1].endswith(" since campaign 2, 2 failure(s)"), lines[at + 1]
    document = json.loads(matrix("gate", "reference", "0.1.0", "--policy", "ep_gate", "--json").output)
    [episode] = document["open_episodes"]
    assert (episode["case"], episode["state"], episode["failures"]) == ("ref_episode", "open", 2)
    assert episode["last_good"]["campaign"] == 1 and episode["first_bad"]["campaign"] == 2

    _sync(matrix, broken=False)
    assert matrix.subprocess("run", "--no-report", "-q").returncode == 0
    healed = matrix("gate", "reference", "0.1.0", "--policy", "ep_gate")
    assert healed.exit_code == 0 and "open episodes" not in healed.output, healed.output
    assert json.loads(matrix("gate", "reference", "0.1.0", "--policy", "ep_gate", "--json").output)[
        "open_episodes"] == []  # fmt: skip
    listed = json.loads(matrix("episodes", "--json").output)["episodes"]
    assert [(e["state"], e["closed_by"]["campaign"]) for e in listed] == [("closed", 4)]
