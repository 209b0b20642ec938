"""The KV fault injector's matrix side ([M28]): which role gets the plugin, that a fresh interpreter finds its
entry point with nothing installed, that the plugin says so loudly when it cannot arm (here: no vLLM at
all), and how a cell is judged from the events. The injections themselves run in a real vLLM engine
(tests/e2e/test_kv_faults_vllm_cpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from matrix.check.faults import events_path, evidence, read_events
from matrix.check.specs import CheckFailure
from matrix.errors import ConfigError
from matrix.kv_faults import parse
from matrix.outcome import FAILED, PASSED, SKIPPED, CellOutcome, checked, failure, judge_fault, passed


def judge(outcome: CellOutcome, spec: str, work_dir: Path) -> CellOutcome:
    """What the runner does after a cell (matrix/runner/attempt.py)."""
    fault = evidence(spec, work_dir)
    return outcome if fault is None else judge_fault(outcome, *fault)


def test_a_class_acts_on_its_side_unless_the_case_names_a_role() -> None:
    assert (parse("bit_flip").fault, parse("bit_flip").role) == ("bit_flip", "decode")
    assert parse("lost_notification").role == "prefill"
    assert parse("stale:prefill").role == "prefill"
    with pytest.raises(ConfigError, match="unknown fault class 'bitflip'; known: bit_flip, stale"):
        parse("bitflip")
    with pytest.raises(ConfigError, match="unknown role 'proxy'"):
        parse("stale:proxy")


def _write_events(work_dir: Path, *events: dict[str, object]) -> None:
    events_path(work_dir).write_text("".join(json.dumps(e) + "\n" for e in events) + '{"torn')


def test_a_fired_fault_passes_the_cell_when_caught_and_fails_it_when_every_check_passed(tmp_path: Path) -> None:
    _write_events(
        tmp_path,
        {"event": "injected", "class": "stale", "request_id": "a", "blocks": [1], "effective": True},
        {"event": "injected", "class": "stale", "request_id": "b", "blocks": [2], "effective": False},
        {"event": "injected", "class": "bit_flip", "request_id": "c", "blocks": [3], "effective": True},
    )
    events = read_events(events_path(tmp_path), "stale")
    assert (events.fired, events.ineffective, events.requests) == (1, 1, ("a",))
    missed = judge(passed(), "stale", tmp_path)
    assert missed.status == FAILED and [c.name for c in missed.checks] == ["fault_undetected"]
    assert "fired 1 times" in missed.message and "1 changed nothing" in missed.message
    caught = judge(checked([CheckFailure("equivalent_to_aggregated", "diverged")]), "stale", tmp_path)
    assert caught.status == PASSED and "caught by: equivalent_to_aggregated" in caught.message
    assert [c.name for c in caught.checks] == ["equivalent_to_aggregated"]  # the evidence stays recorded
    assert evidence(None, tmp_path) is None and evidence("bitflip", tmp_path) is None  # the arm refused that one
    # No evidence about the engines (the runtime did not build): left alone.
    assert judge(failure("provision", "no wheel"), "stale", tmp_path).status == FAILED
    # Only effective injections count: a fault whose injections all changed nothing is not exercised.
    _write_events(tmp_path, {"event": "injected", "class": "drop_last", "request_id": "a", "effective": False})
    assert judge(passed(), "drop_last", tmp_path).status == SKIPPED


def test_the_plugin_inside_the_engine_knows_the_same_classes_on_the_same_sides() -> None:
    """The plugin imports nothing of matrix (it runs in the engine's interpreter), so it has its own copy."""
    from matrix.kv_faults import CLASSES, DEFAULT_ROLE
    from matrix.tools.vllm_kv_faults import matrix_vllm_kv_faults as plugin

    assert plugin.CLASSES == CLASSES and plugin.SIDE == DEFAULT_ROLE
