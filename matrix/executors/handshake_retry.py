"""A grid pair's request retried once when the engines' own KV handshake timed out, and the row says so.

On a loaded host (a 2-core runner while other engines of the grid start), vLLM's NIXL handshake gives up
after its hard-coded 5 s (`zmq.error.Again: Resource temporarily unavailable` in `_nixl_handshake`) and
decode answers 500, while the next request of the same pair, once the handshake is done, gets 200. That is a
transient of the host, not an outcome of the pair: the request is sent once more, and the row's message keeps
the first request's cause line (`matrix.skew_evidence`), so `matrix skew` quotes it whatever the retry says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from matrix.outcome import PASSED, CellOutcome
from matrix.skew_evidence import RETRIED_NOTE, log_handshake_failure

# Checks whose failure means the request got no answer (the only failures a handshake timeout explains).
_NO_ANSWER_CHECKS = frozenset({"http_status", "request"})


def serve_retrying_handshake_timeout(
    serve: Callable[[], CellOutcome], logs: Mapping[str, tuple[Path | None, int]]
) -> CellOutcome:
    """`serve()`, and once more when its request got no answer and an engine's log (from the offset the pair
    began at) shows the KV connector's handshake timing out; the retry's outcome with a line naming the cause."""
    first = serve()
    if first.status == PASSED or not any(check.name in _NO_ANSWER_CHECKS for check in first.checks):
        return first
    for role, (path, offset) in sorted(logs.items()):
        found = log_handshake_failure(path, offset=offset) if path is not None else None
        if found is not None and found.kind == "timeout":
            cause = f"{role}: {found.quote}"
            break
    else:
        return first
    second = serve()
    how = "the retry passed" if second.status == PASSED else f"the retry {second.status} too"
    note = f"{RETRIED_NOTE} the first request's KV handshake timed out ({cause}); {how}"
    return replace(second, message=f"{second.message}\n{note}" if second.message else note)
