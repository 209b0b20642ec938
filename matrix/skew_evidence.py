"""Where a refused request's error was raised, read from the Python tracebacks an engine logged.

An engine's refusal of a peer is known by where it happened, not by its words: vLLM's decode that finds
prefill's KV blocks of another size raises `AssertionError: Local block size 32 is not divisible by remote
block size 64 or vice versa.` from its NIXL connector's `add_remote_agent` (the handshake that sets the
transfer up, before any token), answers 500 and keeps serving. No word list knows the next such message;
the frames do. A traceback whose frames pass through the KV connector's handshake / remote-agent set-up is

- a `timeout` when the exception is a transport one (`zmq.error.Again: Resource temporarily unavailable`:
  vLLM's 5 s NIXL handshake under load, a peer not answering): a transient, not a verdict on the pair;
- a `refusal` otherwise: the connector rejected what the peer sent, and that exception line is the quote.

Log lines carry per-line prefixes (vLLM: `(Worker pid=305) ERROR 12-02 04:30:01 [base_worker.py:1390] `,
matrix's error lines: `line 120: `); a traceback's prefix is the text before `Traceback (most recent call
last):`, digits generalised (timestamps, line numbers and pids change from line to line), and lines of other
processes interleaved with it are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

HandshakeKind = Literal["refusal", "timeout"]

# The connector's handshake and transfer set-up, by function: vLLM's NixlConnector (`_nixl_handshake`,
# `add_remote_agent`, `_validate_remote_agent_handshake`), SGLang's and Dynamo's connectors (`handshake`,
# `register_remote...`, `..._remote_agent`).
_HANDSHAKE_FUNCTION = re.compile(r"handshake|remote_agent|register_remote|add_remote", re.IGNORECASE)
# Exceptions that say the peer did not answer in time (or at all): a transport failure, not a refusal.
_TRANSPORT = re.compile(
    r"(?:^|\.)(?:Again|\w*Timeout\w*|TimeoutError|ConnectionRefusedError|ConnectionResetError|"
    r"ConnectionError|BrokenPipeError)$|Resource temporarily unavailable|timed out",
)
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXCEPTION = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)(?::\s*(?P<text>.*))?$")
# How far a traceback may run (frames, source lines, other processes' lines in between) before it is dropped.
_MAX_TRACEBACK_LINES = 400
_QUOTE_CHARS = 400
# The tag a quoted line carries, so a message (and the class read from it) keeps where the error came from.
REFUSAL_TAG = "[raised in the KV connector's handshake:"
TIMEOUT_TAG = "[the KV connector's handshake timed out in"
# How a grid pair's message says its request was sent twice (`matrix.executors.handshake_retry`).
RETRIED_NOTE = "retried once:"


@dataclass(frozen=True)
class HandshakeFailure:
    kind: HandshakeKind
    exception: str  # the exception line as logged: `AssertionError: Local block size 32 is not divisible ...`
    function: str  # the innermost handshake frame's function
    where: str  # its file's name and line: `base_worker.py:1344`

    @property
    def quote(self) -> str:
        """The exception line with where it was raised: the reason a skew class quotes."""
        if self.kind == "refusal":
            tag = f"{REFUSAL_TAG} {self.function} ({self.where})]"
        else:
            tag = f"{TIMEOUT_TAG} {self.function} ({self.where}): a transient, not a refusal]"
        return f"{self.exception[:_QUOTE_CHARS]} {tag}"


def _prefix_pattern(prefix: str) -> re.Pattern[str]:
    """The traceback's line prefix with its digit runs generalised (timestamps, pids, `line N: `)."""
    parts = re.split(r"\d+", prefix)
    return re.compile(r"\d+".join(re.escape(part) for part in parts))


def _tracebacks(lines: Iterable[str]) -> Iterator[tuple[list[tuple[str, str, str]], str]]:
    """(frames as (file, line, function), exception line) of every traceback in `lines`."""
    it = iter(lines)
    for line in it:
        at = line.find(_TRACEBACK)
        if at < 0:
            continue
        prefix = _prefix_pattern(line[:at])
        frames: list[tuple[str, str, str]] = []
        for _, body in zip(range(_MAX_TRACEBACK_LINES), it, strict=False):
            match = prefix.match(body)
            if match is None:
                continue  # another process's line, interleaved
            text = body[match.end() :].rstrip("\r\n")
            frame = _FRAME.match(text)
            if frame:
                frames.append((frame["file"], frame["line"], frame["func"]))
                continue
            if not text.strip() or text[0].isspace() or text.startswith(_TRACEBACK):
                continue  # a source line, a caret line, a blank
            if text.startswith(("During handling", "The above exception")):
                continue  # a chained traceback: its frames belong to the same failure
            if frames and _EXCEPTION.match(text.split(" ", 1)[0].rstrip(":")):
                yield frames, text.strip()
            break


def handshake_failure(lines: Iterable[str]) -> HandshakeFailure | None:
    """The first refusal raised through the KV connector's handshake in `lines`, else the first handshake
    timeout, else None: a pair retried after a timeout and then refused is a refusal."""
    timeout: HandshakeFailure | None = None
    for frames, exception in _tracebacks(lines):
        inside = [(file, line, func) for file, line, func in frames if _HANDSHAKE_FUNCTION.search(func)]
        if not inside:
            continue
        file, line, func = inside[-1]  # the innermost handshake frame: where the check (or the wait) was
        name = exception.split(":", 1)[0].strip()
        transport = _TRANSPORT.search(name) is not None or _TRANSPORT.search(exception) is not None
        found = HandshakeFailure("timeout" if transport else "refusal", exception, func, f"{Path(file).name}:{line}")
        if found.kind == "refusal":
            return found
        timeout = timeout or found
    return timeout


def log_handshake_failure(log: Path, scan_bytes: int = 64 * 2**20, offset: int = 0) -> HandshakeFailure | None:
    """`handshake_failure` of a log file's `scan_bytes` from `offset` (a shared engine's log: from where a
    pair's lines begin); None when it cannot be read."""

    def lines() -> Iterator[str]:
        with log.open("rb") as handle:
            handle.seek(offset)
            scan_end = offset + scan_bytes
            for raw in iter(lambda: handle.readline(65_536), b""):
                if handle.tell() > scan_end:
                    return
                yield raw.decode("utf-8", "replace")

    try:
        return handshake_failure(lines())
    except OSError:
        return None
