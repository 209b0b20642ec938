"""Decode logs as vLLM CPU 0.32.0 writes them: a block-size refusal raised in the NIXL handshake, and a
handshake that timed out (shared by the skew evidence tests)."""

from __future__ import annotations

SITE = "/env/lib/python3.12/site-packages"
NIXL = f"{SITE}/vllm/distributed/kv_transfer/kv_connector/v1/nixl"
HEAD = "(Worker pid=3071) ERROR 12-02 05:12:{s:02d} [base_worker.py:1402] "
BLOCKS = "AssertionError: Local block size 32 is not divisible by remote block size 64 or vice versa."


def record(message: str, body: list[str], second: int = 7) -> str:
    """One vLLM log record with a traceback: every line under the record's own header, as vLLM prints it."""
    head = HEAD.format(s=second)
    return "".join(f"{head}{line}\n" for line in [message, "Traceback (most recent call last):", *body])


def handshake_traceback(innermost: list[str], exception: str) -> list[str]:
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
    + record(
        "NIXL transfer failure: handshake_setup_failed | Context: {'remote_engine_id': 'e3c1', 'remote_port': 40411}",
        handshake_traceback(
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


TIMEOUT_LOG = record(
    "NIXL transfer failure: handshake_setup_failed | Context: {'remote_engine_id': '4b54', 'remote_port': 40123}",
    handshake_traceback(
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
