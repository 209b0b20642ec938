"""A refused skew pair is known by where its error was raised ([M29] item 10), and an engine's own handshake
timeout is quoted as the cause of an error answer ([M29] item 11): decode logs as vLLM CPU 0.32.0 writes them."""

from __future__ import annotations

from pathlib import Path

from matrix.skew_evidence import handshake_failure
from matrix.skew_outcome import classify, first_incompatibility, logged_refusal

SITE = "/env/lib/python3.12/site-packages"
NIXL = f"{SITE}/vllm/distributed/kv_transfer/kv_connector/v1/nixl"
HEAD = "(Worker pid=3071) ERROR 12-02 05:12:{s:02d} [base_worker.py:1402] "
BLOCKS = "AssertionError: Local block size 32 is not divisible by remote block size 64 or vice versa."


def _record(message: str, body: list[str], second: int = 7) -> str:
    """One vLLM log record with a traceback: every line under the record's own header, as vLLM prints it."""
    head = HEAD.format(s=second)
    return "".join(f"{head}{line}\n" for line in [message, "Traceback (most recent call last):", *body])


def _handshake_traceback(innermost: list[str], exception: str) -> list[str]:
    return [
        f'  File "{NIXL}/base_worker.py", line 1398, in done_callback',
        "    self._remote_agents[eid] = f.result()",
        '  File "/usr/lib/python3.12/concurrent/futures/_base.py", line 449, in result',
        "    return self.__get_result()",
        '  File "/usr/lib/python3.12/concurrent/futures/thread.py", line 59, in run',
        "    result = self.fn(*self.args, **self.kwargs)",
        f'  File "{NIXL}/base_worker.py", line 1021, in _nixl_handshake',
        *innermost,
        exception,
    ]


BLOCK_LOG = (
    "(APIServer pid=3012) INFO 12-02 05:11:58 [api_server.py:1871] Starting vLLM API server 0 on http://127.0.0.1:8101\n"
    + _record(
        "NIXL transfer failure: handshake_setup_failed | Context: {'remote_engine_id': 'e3c1', 'remote_port': 40411}",
        _handshake_traceback(
            [
                "    remote_agent_name = self.add_remote_agent(metadata, p_remote_rank, remote_tp_size)",
                "                        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
                f'  File "{NIXL}/base_worker.py", line 1262, in add_remote_agent',
                "    self._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size)",
                f'  File "{NIXL}/base_worker.py", line 1344, in _validate_remote_agent_handshake',
                "    assert self.block_size % remote_block_size == 0 or remote_block_size % self.block_size == 0, (",
            ],
            BLOCKS,
        ),
    )
    + "(APIServer pid=3012) INFO 12-02 05:12:07 [launcher.py:46] Route: /v1/completions, Methods: POST\n"
    "(Worker pid=3071) ERROR 12-02 05:12:07 [base_worker.py:2210] Failing 1 request(s) due to KV load failure "
    "(failure_policy=fail, handshake_failed)\n"
    '(APIServer pid=3012) INFO:     127.0.0.1:51874 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error\n'
)

TIMEOUT_LOG = _record(
    "NIXL transfer failure: handshake_setup_failed | Context: {'remote_engine_id': '4b54', 'remote_port': 40123}",
    _handshake_traceback(
        [
            "    _, metadata_bytes = sock.recv_multipart()",
            f'  File "{SITE}/zmq/sugar/socket.py", line 805, in recv_multipart',
            "    parts = [self.recv(flags, copy=copy, track=track)]",
            '  File "_zmq.py", line 1137, in zmq.backend.cython._zmq.Socket.recv',
            '  File "_zmq.py", line 179, in zmq.backend.cython._zmq._check_rc',
        ],
        "zmq.error.Again: Resource temporarily unavailable",
    ),
    second=12,
)

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
    elsewhere = _record("EngineCore encountered a fatal error.", [
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
