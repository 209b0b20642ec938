"""`matrix run` over the host provider: a runtime whose installed components are not the catalog's fails
as `config` (version skew); one whose components match runs and records them."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from tests.helpers.cli import Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CLICK = version("click")


def _latest(m: Matrix, runtime_version: str) -> dict[str, object]:
    result = m("show", f"reference_disaggregated@reference-{runtime_version}", "--json")
    assert result.exit_code == 0, result.output
    data: dict[str, object] = json.loads(result.output)
    return data


def test_component_mismatch_fails_as_config_and_a_match_runs(seeded: Matrix) -> None:
    assert seeded("runtime", "add", "reference", "0.2.0", "--component", "click=0.0.1").exit_code == 0
    assert seeded("runtime", "add", "reference", "0.3.0", "--component", f"click={CLICK}").exit_code == 0
    run = seeded.subprocess("run", "--case", "reference_disaggregated", "--runtime", "reference=0.2.0",
                            "--runtime", "reference=0.3.0", "--json-events")  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    wrong = _latest(seeded, "0.2.0")
    assert (wrong["status"], wrong["failure_kind"]) == ("failed", "config")
    assert wrong["message"] == f"runtime says click 0.0.1, host has {CLICK}"
    right = _latest(seeded, "0.3.0")
    assert right["status"] == "passed", right
    assert right["components"] == {"click": CLICK}
