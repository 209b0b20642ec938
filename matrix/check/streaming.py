"""The primary request once more with ``stream=true``: the `stream` check and the cell's time to first token.

The stream is parsed as SSE by `matrix.check.client` (usage from the final chunk, worker ids from the
chunk that carries `nvext`) and assembled into one ``chat.completion``, which the same named checks as the
non-streaming answer judge. A failure keeps the check's own name (`worker_ids_distinct`...) with a
``stream:`` prefix, so a control case that must fail one check fails that same one in both modes; a stream
that breaks its protocol or never completes fails `stream`.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from matrix.check.client import send_chat
from matrix.check.specs import CheckFailure, RequestSpec
from matrix.check.validate import Validation, validate_chat_response

CHECK_NAME = "stream"
EVIDENCE_FILE = "stream.json"


@dataclass(frozen=True)
class StreamResult:
    failures: tuple[CheckFailure, ...]
    ttft_s: float | None
    request_s: float
    validation: Validation | None


def stream_check(request: RequestSpec, record_dir: Path | None = None) -> StreamResult:
    """Send the streaming request, validate its assembled answer, keep the evidence in `record_dir`."""
    response = send_chat(request, stream=True)
    validation: Validation | None = None
    if response.error is not None:
        failures: tuple[CheckFailure, ...] = (
            CheckFailure(CHECK_NAME, f"stream: {response.error_kind}: {response.error}"),
        )
    else:
        validation = validate_chat_response(response.status_code, response.body)
        failures = tuple(CheckFailure(f.name, f"stream: {f.message}") for f in validation.failures)
    if record_dir is not None:
        _record(record_dir, response.status_code, response.body, response.ttft_s, response.request_s, failures)
    return StreamResult(failures, response.ttft_s, response.request_s, validation)


def _record(
    record_dir: Path,
    status: int | None,
    body: bytes,
    ttft_s: float | None,
    request_s: float,
    failures: tuple[CheckFailure, ...],
) -> None:
    document = {
        "check": CHECK_NAME,
        "status_code": status,
        "ttft_s": None if ttft_s is None else round(ttft_s, 4),
        "request_s": round(request_s, 4),
        "failures": [{"name": f.name, "message": f.message} for f in failures],
        # The assembled answer (or the raw bytes of a broken stream), as validated.
        "body": body[:65536].decode("utf-8", errors="replace"),
    }
    with contextlib.suppress(OSError):  # evidence only: a write error is not a check failure
        (record_dir / EVIDENCE_FILE).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
