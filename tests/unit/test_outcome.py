"""The outcome vocabulary is one list: `cell_run`, the database writer, shard files, `show` and the JSON
export agree with `matrix.outcome`, so a new outcome field cannot be forgotten in one of them."""

from __future__ import annotations

import dataclasses

import pytest

from matrix.check.specs import CheckFailure
from matrix.db.models import Backend, Case, CellRun, Runtime
from matrix.fanout.shard_results import OUTCOME_FIELDS
from matrix.outcome import (
    CELL_FAULT_STATUSES,
    FAILED_STATUSES,
    FINISHED_STATUSES,
    NOT_STORED,
    STATUSES,
    STORED_COLUMNS,
    CellOutcome,
    after_teardown,
    checked,
    checked_again,
    interrupted,
    judge_control,
    judge_expectation,
    judge_listeners,
    retryable,
    with_flaky,
)
from matrix.report.data import AttemptDetail
from matrix.report.export_json import attempt_dict
from matrix.results import record_outcome
from matrix.results_read import describe_cell

# `matrix show` predates the flaky column and does not print it (its output is unchanged by M13).


def test_every_outcome_field_is_stored_or_says_why_not() -> None:
    fields = {f.name for f in dataclasses.fields(CellOutcome)}
    assert fields == set(STORED_COLUMNS) | set(NOT_STORED)
    assert not set(STORED_COLUMNS) & set(NOT_STORED)
    assert set(STORED_COLUMNS) | {"log_dir"} <= set(CellRun.__table__.columns.keys())


def test_status_sets_have_one_meaning_each() -> None:
    assert FAILED_STATUSES <= FINISHED_STATUSES <= set(STATUSES)
    assert {"interrupted"} == FAILED_STATUSES - CELL_FAULT_STATUSES
    assert "skipped" not in FAILED_STATUSES and "passed" not in FAILED_STATUSES


def test_the_writer_stores_every_column_of_a_full_outcome() -> None:
    outcome = CellOutcome(
        status="failed", failure_kind="validation", message="bad\x00 body", checks=(CheckFailure("json_body", "x"),),
        ready_s=1.0, request_s=2.0, ttft_s=0.5, teardown_s=3.0, total_s=7.0,
        prefill_worker_id=2**64 - 1, decode_worker_id=7, prompt_tokens=5, completion_tokens=9,
        finish_reason="length", completion_excerpt="hello", ports={"frontend": 8000}, exit_codes={"decode": 0},
        log_dir="logs/c1", components={"vllm": "0.11"}, gpu={"index": "0"}, queued_s=0.25,
        peaks={"decode": {"rss_mib": 10}}, expected_failure="lacks vllm#1", unexpected_pass=True, flaky=True,
        listeners=({"role": "decode", "proto": "tcp", "address": "0.0.0.0", "port": 5557},),
    )  # fmt: skip
    row = CellRun(log_dir="")
    record_outcome(row, outcome)
    stored = {name: getattr(row, name) for name in STORED_COLUMNS}
    assert stored["message"] == "bad\\x00 body"  # text a process produced is made storable
    assert stored["checks"] == [{"name": "json_body", "message": "x"}]
    assert stored["prefill_worker_id"] == str(2**64 - 1) and stored["decode_worker_id"] == "7"
    assert stored["listeners"] == [{"role": "decode", "proto": "tcp", "address": "0.0.0.0", "port": 5557}]
    plain = {n for n in STORED_COLUMNS
             if n not in ("message", "checks", "prefill_worker_id", "decode_worker_id", "listeners")}  # fmt: skip
    assert {n: stored[n] for n in plain} == {n: getattr(outcome, n) for n in plain}
    assert row.log_dir == "logs/c1" and row.finished_at is not None


def test_shard_files_carry_every_stored_column_and_when_it_ran() -> None:
    assert set(OUTCOME_FIELDS) == set(STORED_COLUMNS) | {"started_at", "finished_at", "owner_host"}
    assert all(OUTCOME_FIELDS[name] == types for name, types in STORED_COLUMNS.items())


def test_show_and_the_json_export_print_every_stored_column() -> None:
    row = CellRun(uid="c1", campaign_id=1, attempt=1, log_dir="")
    record_outcome(row, CellOutcome("passed"))
    row.case = Case(name="case")
    row.runtime = Runtime(version="1.0", backend=Backend(name="reference"))
    assert set(STORED_COLUMNS) <= set(describe_cell(row))
    assert set(STORED_COLUMNS) <= set(AttemptDetail._fields)
    values = {name: getattr(row, name, None) for name in AttemptDetail._fields}
    assert set(STORED_COLUMNS) <= set(attempt_dict(AttemptDetail(**values)))


# --- the decision rules (matrix.outcome), the one place a status is decided from evidence ----------------


def test_checked_passes_without_failures_and_names_each_failed_check_once() -> None:
    assert checked([], ready_s=1.0) == CellOutcome("passed", ready_s=1.0)
    failures = [CheckFailure("json_body", "a"), CheckFailure("json_body", "b"), CheckFailure("usage", "c")]
    outcome = checked(failures)
    assert (outcome.status, outcome.failure_kind) == ("failed", "validation")
    assert outcome.message == "failed checks: json_body, usage" and len(outcome.checks) == 3


def test_a_teardown_failure_fails_a_pass_and_is_added_to_a_failure() -> None:
    leak = [CheckFailure("teardown_clean", "left a process")]
    failed = after_teardown(CellOutcome("passed"), leak)
    assert (failed.status, failed.failure_kind, failed.checks) == ("failed", "teardown", tuple(leak))
    earlier = CellOutcome("failed", "request", "boom", checks=(CheckFailure("request", "x"),))
    kept = after_teardown(earlier, leak)
    assert (kept.status, kept.failure_kind, kept.message) == ("failed", "request", "boom")
    assert [c.name for c in kept.checks] == ["request", "teardown_clean"]
    assert after_teardown(CellOutcome("passed"), []) == CellOutcome("passed")


def test_a_later_check_fails_a_pass_and_keeps_what_it_measured() -> None:
    pair = CellOutcome("passed", message="note", ready_s=2.0, ports={"prefill": 1})
    diverged = [CheckFailure("equivalent_to_aggregated", "prompt 3 diverges")]
    failed = checked_again(pair, diverged, "aggregated instance 4.0 s")
    assert (failed.status, failed.failure_kind, failed.checks) == ("failed", "validation", tuple(diverged))
    assert failed.message == "failed checks: equivalent_to_aggregated; aggregated instance 4.0 s"
    assert (failed.ready_s, failed.ports) == (2.0, {"prefill": 1})
    kept = checked_again(pair, [], "16/16 identical")
    assert (kept.status, kept.message, kept.checks) == ("passed", "note; 16/16 identical", ())
    assert checked_again(CellOutcome("passed"), [], "16/16").message == "16/16"
    earlier = CellOutcome("failed", "request", "boom")
    assert checked_again(earlier, diverged, "x") == earlier


def test_a_control_passes_only_when_exactly_its_checks_fail() -> None:
    control = ["worker_ids_distinct"]
    caught = checked([CheckFailure("worker_ids_distinct", "same worker")])
    assert judge_control(caught, control).status == "passed"
    blind = judge_control(CellOutcome("passed"), control)
    assert (blind.status, blind.checks[0].name) == ("failed", "control_expectation")
    other = checked([CheckFailure("usage", "x")])
    assert judge_control(other, control) == other
    assert judge_control(CellOutcome("skipped"), control).status == "skipped"


def test_an_expected_failure_is_noted_and_a_pass_there_is_unexpected() -> None:
    assert judge_expectation(CellOutcome("failed", "request"), "lacks vllm#1").expected_failure == "lacks vllm#1"
    surprise = judge_expectation(CellOutcome("passed"), "lacks vllm#1")
    assert surprise.unexpected_pass and surprise.status == "passed"
    config = CellOutcome("failed", "config")
    assert judge_expectation(config, "lacks vllm#1") == config  # a config failure says nothing about the fix
    assert judge_expectation(CellOutcome("passed"), "") == CellOutcome("passed")


def test_the_scheduler_rules_interrupt_retry_and_flaky() -> None:
    assert interrupted(CellOutcome("passed"), "stop") == CellOutcome("passed")
    cut = interrupted(CellOutcome("failed", "health", "x"), "stop")
    assert (cut.status, cut.failure_kind, cut.message) == ("interrupted", "infra", "stop")
    assert retryable(CellOutcome("timeout", "health")) and retryable(cut)
    assert not retryable(CellOutcome("failed", "validation")) and not retryable(CellOutcome("passed"))
    assert with_flaky(CellOutcome("passed"), True).flaky
    assert not with_flaky(CellOutcome("failed", "health"), True).flaky
    assert not with_flaky(CellOutcome("passed"), False).flaky


@pytest.mark.parametrize(
    ("address", "reachable"),
    [("127.0.0.1", False), ("127.0.0.53", False), ("::1", False), ("::ffff:127.0.0.1", False), ("0.0.0.0", True),
     ("::", True), ("10.1.2.3", True), ("fe80::1%eth0", True)],
)  # fmt: skip
def test_listeners_beyond_loopback_are_named_and_fail_only_under_loopback_only(address: str, reachable: bool) -> None:
    # [M21] item 11: every listener is evidence; one another host could reach is said, and fails when asked.
    listener = {"role": "decode", "proto": "tcp", "address": address, "port": 5557}
    passed = CellOutcome("passed", listeners=(listener,))
    noted = judge_listeners(passed, loopback_only=False)
    strict = judge_listeners(passed, loopback_only=True)
    if not reachable:
        assert noted == passed and strict == passed
        return
    shown = f"[{address}]" if ":" in address else address
    assert noted.status == "passed" and noted.message == f"listens beyond loopback: decode {shown}:5557/tcp"
    assert strict.status == "failed" and strict.failure_kind == "validation"
    assert [c.name for c in strict.checks] == ["loopback_only"] and "beyond loopback" in strict.message


@pytest.mark.parametrize(("line", "said"), [
    ("2026-12-04T17:06:53Z prefill[7] RuntimeError: NIXL >= 1.5.0 is required, but nixl==1.4.1 is installed",
     "RuntimeError: NIXL >= 1.5.0 is required, but nixl==1.4.1 is installed"),
    ("ImportError: tokenizers>=0.21,<0.22 is required for a normal functioning of this module, but found "
     "tokenizers==0.22.0.", "ImportError: tokenizers>=0.21,<0.22 is required for a normal functioning of this "
     "module, but found tokenizers==0.22.0."),
    ("ERROR: foo 1.0 requires bar>=2.0, but you have bar 1.5 which is incompatible.",
     "foo 1.0 requires bar>=2.0, but you have bar 1.5 which is incompatible"),
    ("ModuleNotFoundError: No module named 'nixl'", None),
    ("error: engine core failed to start: simulated crash (fault crash-at-start)", None),
    ("CUDA out of memory. Tried to allocate 2.00 GiB; 1.5 GiB is required but only 0.5 GiB is free", None),
])  # fmt: skip
def test_unmet_requirement_names_the_engines_refusal_of_a_dependency(line: str, said: str | None) -> None:
    from matrix.outcome import unmet_requirement

    assert unmet_requirement(f"started\n{line}\nexiting") == said
