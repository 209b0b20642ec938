"""The KV fault plugin seen by a fresh interpreter ([M28]): only the faulted role's PYTHONPATH names it, its
`vllm.general_plugins` entry point is found, and without vLLM it writes a `not_armed` event instead of doing
nothing silently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from matrix.check.faults import events_path, evidence, read_events
from matrix.check.specs import CheckFailure
from matrix.launch.faults import role_env
from matrix.outcome import SKIPPED, CellOutcome, checked, judge_fault, passed

pytestmark = pytest.mark.e2e


def judge(outcome: CellOutcome, spec: str, work_dir: Path) -> CellOutcome:
    """What the runner does after a cell (matrix/runner/attempt.py)."""
    fault = evidence(spec, work_dir)
    return outcome if fault is None else judge_fault(outcome, *fault)


def test_only_the_faulted_role_gets_the_plugin_and_a_fresh_interpreter_finds_its_entry_point(tmp_path: Path) -> None:
    assert role_env(None, "decode", tmp_path, {}) == {}
    assert role_env("bit_flip", "prefill", tmp_path, {}) == {}  # decode's fault: prefill runs untouched
    env = role_env("bit_flip", "decode", tmp_path, {"PYTHONPATH": "/elsewhere"})
    site, inherited = env["PYTHONPATH"].split(":")
    assert inherited == "/elsewhere" and env["MATRIX_KV_FAULT"] == "bit_flip"
    assert env["MATRIX_KV_FAULT_EVENTS"] == str(events_path(tmp_path))
    # What vLLM's plugin loader does: entry points of group vllm.general_plugins, then load() and call. This
    # interpreter has no vLLM, so the plugin cannot arm and must say so in the events file.
    probe = (
        "import importlib.metadata as m\n"
        "(ep,) = [e for e in m.entry_points(group='vllm.general_plugins') if e.name == 'matrix_kv_faults']\n"
        "ep.load()()\n"
    )
    run_env = {
        "PYTHONPATH": site,
        "MATRIX_KV_FAULT": "bit_flip",
        "MATRIX_KV_FAULT_EVENTS": env["MATRIX_KV_FAULT_EVENTS"],
    }
    result = subprocess.run([sys.executable, "-c", probe], env=run_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    (event,) = [json.loads(line) for line in events_path(tmp_path).read_text().splitlines()]
    assert event["event"] == "not_armed" and "no NixlConnector worker class found" in event["why"]
    events = read_events(events_path(tmp_path), "bit_flip")
    assert events.fired == 0 and events.not_armed == (event["why"],)
    # A cell whose fault never fired is neither a pass nor a fail, whatever its checks said.
    for outcome in (passed(), checked([CheckFailure("content_nonblank", "blank")])):
        judged = judge(outcome, "bit_flip", tmp_path)
        assert judged.status == SKIPPED and judged.message.startswith("not exercised: kv fault bit_flip on decode")
        assert "not armed: no NixlConnector worker class found" in judged.message
