"""A refused skew pair is known by where its error was raised ([M29] item 10), and an engine's own handshake
timeout is quoted as the cause of an error answer ([M29] item 11): decode logs as vLLM CPU 0.32.0 writes them."""

from __future__ import annotations

from pathlib import Path

from matrix.skew_evidence import handshake_failure
from matrix.skew_outcome import classify, first_incompatibility, logged_refusal
from tests.helpers.vllm_logs import BLOCK_LOG, BLOCKS, SITE, TIMEOUT_LOG, record

REFUSED = [{"name": "http_status", "message": "HTTP status is 500; expected 200; body \"{'message': 'Internal "
            "server error'}\""}, {"name": "kv_transfer", "message": "no NIXL transfer"}]  # fmt: skip


def test_the_block_size_assertion_is_a_refusal_by_where_it_was_raised(tmp_path: Path) -> None:
    found = handshake_failure(BLOCK_LOG.splitlines())
    assert found is not None and found.kind == "refusal"
    assert (found.exception, found.function, found.where) == (
        BLOCKS,
        "_validate_remote_agent_handshake",
        "base_worker.py:1344",
    )
    log = tmp_path / "decode.log"
    log.write_text(BLOCK_LOG)
    said = first_incompatibility(log)
    assert said is not None and said.startswith(BLOCKS) and "_validate_remote_agent_handshake" in said
    # What the runner makes of it: the quote heads decode's error lines in the attempt's message.
    message = f"failed checks: http_status, kv_transfer\n--- error lines (decode.log) ---\n{said}"
    verdict = classify("failed", "validation", message, REFUSED, {})
    assert verdict.cls == "clean-reject" and verdict.reason.startswith(BLOCKS), verdict
    # An attempt recorded without it is explained from the log where it lies (the report's path).
    assert classify("failed", "validation", f"failed checks: http_status\n{logged_refusal(str(tmp_path))}",
                    REFUSED, {}).cls == "clean-reject"  # fmt: skip
    # The traceback in the message itself (matrix's `line N: ` prefixes) is read the same way.
    numbered = "\n".join(f"line {n}: {line}" for n, line in enumerate(BLOCK_LOG.splitlines(), 10))
    assert classify("failed", "request", numbered, REFUSED, {}).cls == "clean-reject"


def test_the_same_assertion_outside_the_handshake_is_not_a_refusal() -> None:
    elsewhere = record("EngineCore encountered a fatal error.", [
        f'  File "{SITE}/vllm/v1/core/sched/scheduler.py", line 310, in schedule',
        "    assert num_new_tokens > 0",
        BLOCKS,
    ])  # fmt: skip
    assert handshake_failure(elsewhere.splitlines()) is None
    verdict = classify("failed", "validation", f"failed checks: http_status\n{elsewhere}", REFUSED, {})
    assert verdict.cls == "error-answer", verdict


def test_a_handshake_timeout_is_an_error_answer_that_quotes_its_cause(tmp_path: Path) -> None:
    found = handshake_failure(TIMEOUT_LOG.splitlines())
    assert found is not None and found.kind == "timeout" and found.function == "_nixl_handshake"
    log = tmp_path / "decode.log"
    log.write_text(TIMEOUT_LOG)
    said = first_incompatibility(log)
    assert said is not None and said.startswith("zmq.error.Again: Resource temporarily unavailable")
    message = f"failed checks: http_status, kv_transfer\n--- error lines (decode.log) ---\n{said}"
    verdict = classify("failed", "validation", message, REFUSED, {})
    assert verdict.cls == "error-answer", verdict
    assert "handshake timed out" in verdict.reason and "zmq.error.Again: Resource temporarily" in verdict.reason


def test_interleaved_lines_of_other_processes_do_not_break_a_traceback() -> None:
    lines = BLOCK_LOG.splitlines()
    at = next(i for i, line in enumerate(lines) if "in _nixl_handshake" in line)
    lines.insert(at, "(APIServer pid=3012) INFO 12-02 05:12:07 [loggers.py:123] Engine 000: Avg prompt throughput")
    found = handshake_failure(lines)
    assert found is not None and found.exception == BLOCKS


def test_a_refusal_after_a_timed_out_handshake_is_the_refusal() -> None:
    """A pair retried after its handshake timed out, then refused: the log's refusal decides, not the timeout."""
    found = handshake_failure((TIMEOUT_LOG + BLOCK_LOG).splitlines())
    assert found is not None and (found.kind, found.exception) == ("refusal", BLOCKS)
