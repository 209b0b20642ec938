"""[M11] item 7: `-m ""` means no marker filter, as on pytest's command line, on every command taking -m."""

from __future__ import annotations

import json

from tests.helpers.cli import Matrix


def _keys(output: str) -> list[str]:
    return sorted(c["cell"] for c in json.loads(output)["cells"])


def test_plan_with_an_empty_expression_plans_everything(seeded: Matrix) -> None:
    everything = seeded("plan", "--json")
    empty = seeded("plan", "--json", "-m", "")
    assert empty.exit_code == 0, empty.output
    assert _keys(empty.output) and _keys(empty.output) == _keys(everything.output)
    scoped = seeded("plan", "--json", "-m", "", "--backend", "reference")
    assert _keys(scoped.output) == _keys(seeded("plan", "--json", "--backend", "reference").output)
    for fmt in ("json", "markdown", "junit"):
        assert seeded("export", fmt, "-m", "").exit_code == 0
    assert seeded("report", "-m", "", "--out", str(seeded.home / "r")).exit_code == 0
