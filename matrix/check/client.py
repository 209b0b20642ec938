"""Send the cell's one chat completion (`build_payload`) and measure it.

One request, one `Response`: never an exception for anything the server or the network does. Transport
failures, timeouts, oversized bodies and broken streams come back as ``error``/``error_kind`` so the cell
runner can record them next to the validation, and so a hung or hostile server cannot take the runner
down (the body is read in pieces and reading stops at ``max_response_bytes``).

With ``stream=True`` the Server-Sent Events stream is parsed as it arrives, which gives a real time to first
token, and its chunks are assembled into one non-streaming ``chat.completion`` body so that
`matrix.check.validate.validate_chat_response` applies unchanged to both modes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import httpx

from matrix.check.http import loopback_client
from matrix.check.specs import RequestSpec
from matrix.text import excerpt

__all__ = ["ERROR_KINDS", "ErrorKind", "Response", "build_payload", "send_chat"]

ErrorKind = Literal["connect", "timeout", "oversized", "protocol"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("connect", "timeout", "oversized", "protocol")
"""What went wrong in transport: no connection, no complete answer in time, a body over the size cap, or
a response that broke HTTP or the SSE protocol (reset mid-body, undecodable stream, error event)."""

_EXCERPT_CHARS = 200


@dataclass(frozen=True)
class Response:
    """What came back from one chat-completion request.

    `status_code` is None when no HTTP response arrived. `body` is the raw body (truncated at the size cap),
    except for a complete stream, where it is the assembled non-streaming JSON and `content_type` is
    ``application/json``. `request_s` is the whole exchange, from before connecting to the last byte read;
    `ttft_s` is the time to the first chunk carrying generated text, for streams only.
    """

    status_code: int | None
    body: bytes
    content_type: str
    request_s: float
    ttft_s: float | None
    error: str | None
    error_kind: ErrorKind | None


def build_payload(spec: RequestSpec, *, stream: bool = False) -> dict[str, object]:
    """The request body every cell sends: one user message, greedy, one choice, worker ids asked for.

    ``temperature=0`` and ``n=1`` make the answer reproducible and the one-choice check meaningful;
    ``nvext.extra_fields=["worker_id"]`` asks a Dynamo frontend to report which prefill and decode workers
    served the request. A streaming request also asks for usage in the stream (``stream_options``), since
    OpenAI-compatible servers omit it from streams by default and the usage checks need it.
    """
    payload: dict[str, object] = {
        "model": spec.model,
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "n": 1,
        "temperature": 0,
        "stream": stream,
        "nvext": {"extra_fields": ["worker_id"]},
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def send_chat(spec: RequestSpec, *, stream: bool = False, client: httpx.Client | None = None) -> Response:
    """POST the chat completion to `spec.url` (the full endpoint URL) and return what came back.

    Without `client`, a private client is used with ``trust_env=False``: the runner talks to engines on
    this host or cluster, and an inherited ``HTTP_PROXY`` would send the request somewhere else. A caller
    passing its own client is responsible for that setting.

    Every network operation (connect, each read, write) is limited to ``spec.timeout_s``, and the whole
    exchange is checked against the same budget between received pieces, so a server that trickles bytes
    cannot stretch it indefinitely; a read that blocks is still bounded by the per-read limit.
    """
    payload = build_payload(spec, stream=stream)
    started = time.perf_counter()
    own_client = client is None
    http = client if client is not None else loopback_client(spec.timeout_s)
    try:
        return _exchange(http, spec, payload, stream=stream, started=started)
    finally:
        if own_client:
            http.close()


@dataclass
class _Exchange:
    """Mutable state of one request while it is being read."""

    started: float
    status_code: int | None = None
    content_type: str = ""
    received: bytearray = field(default_factory=bytearray)
    ttft_s: float | None = None

    def result(
        self,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
        error: str | None = None,
        error_kind: ErrorKind | None = None,
    ) -> Response:
        return Response(
            status_code=self.status_code,
            body=bytes(self.received) if body is None else body,
            content_type=self.content_type if content_type is None else content_type,
            request_s=time.perf_counter() - self.started,
            ttft_s=self.ttft_s,
            error=error,
            error_kind=error_kind,
        )


class _StreamError(Exception):
    """The SSE stream broke its protocol; the message says how."""


def _exchange(
    http: httpx.Client, spec: RequestSpec, payload: dict[str, object], *, stream: bool, started: float
) -> Response:
    state = _Exchange(started)
    headers = {
        "Accept": "text/event-stream" if stream else "application/json",
        # No compression: the size cap then bounds memory directly, and a compressed body cannot expand
        # past it inside a single decoded piece.
        "Accept-Encoding": "identity",
    }
    try:
        with http.stream("POST", spec.url, json=payload, headers=headers, timeout=spec.timeout_s) as response:
            state.status_code = response.status_code
            state.content_type = response.headers.get("content-type", "")
            is_sse = state.content_type.split(";")[0].strip().lower() == "text/event-stream"
            # Only a successful stream is assembled; an error answer (e.g. 503 with a JSON body) is kept as
            # sent, and a server that ignored stream=true is validated on its plain JSON body.
            assembler = _StreamAssembler(started) if stream and response.status_code == 200 and is_sse else None
            return _read_body(response.iter_bytes(), spec, state, assembler)
    except httpx.TimeoutException as exc:
        return state.result(
            error=f"timed out after {spec.timeout_s:g} s ({type(exc).__name__}) on {spec.url}",
            error_kind="timeout",
        )
    except (httpx.ConnectError, httpx.UnsupportedProtocol, httpx.ProxyError, httpx.InvalidURL) as exc:
        return state.result(error=f"cannot connect to {spec.url}: {exc}", error_kind="connect")
    except httpx.HTTPError as exc:
        # Reset or malformed HTTP mid-response: the server answered, then broke the exchange.
        return state.result(
            error=f"broken response from {spec.url} ({type(exc).__name__}): {exc}", error_kind="protocol"
        )


def _read_body(
    pieces: Iterator[bytes], spec: RequestSpec, state: _Exchange, assembler: _StreamAssembler | None
) -> Response:
    """Read pieces until the end, the size cap, the time budget or the stream's ``[DONE]``."""
    limit = spec.max_response_bytes
    try:
        for piece in pieces:
            room = limit - len(state.received)
            if len(piece) > room:
                state.received += piece[:room]
                return state.result(
                    error=f"response exceeded {limit} bytes; stopped reading, body truncated",
                    error_kind="oversized",
                )
            state.received += piece
            if assembler is not None:
                assembler.feed(piece)
                state.ttft_s = assembler.ttft_s
                if assembler.done:
                    break
            if time.perf_counter() - state.started > spec.timeout_s:
                return state.result(
                    error=f"no complete response within {spec.timeout_s:g} s; stopped reading",
                    error_kind="timeout",
                )
        if assembler is None:
            return state.result()
        assembler.finish()
        state.ttft_s = assembler.ttft_s
        if not assembler.done:
            raise _StreamError("stream ended without 'data: [DONE]'")
        return state.result(body=assembler.body(), content_type="application/json")
    except _StreamError as exc:
        # The raw bytes are kept so the report shows what the server actually streamed.
        return state.result(error=f"broken event stream: {exc}", error_kind="protocol")


class _SSEParser:
    """Incremental Server-Sent Events parser (WHATWG event-stream format).

    Lines end in CRLF, LF or CR, possibly split across network pieces; an event is the ``data:`` lines
    before a blank line, joined with newlines. Comments (``:``) and ``id``/``retry`` fields are ignored.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._event_type = ""
        self._data: list[str] = []

    def feed(self, piece: bytes) -> list[tuple[str, str]]:
        """Add received bytes; return the complete events, as (event type, data)."""
        self._buffer += piece
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        """End of stream: a last line without terminator still counts, and a pending event is dispatched."""
        events = self._drain(final=True)
        if self._buffer:
            event = self._line(bytes(self._buffer))
            self._buffer.clear()
            if event is not None:
                events.append(event)
        event = self._line(b"")
        if event is not None:
            events.append(event)
        return events

    def _drain(self, *, final: bool) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        while True:
            cr, lf = self._buffer.find(b"\r"), self._buffer.find(b"\n")
            ends = [index for index in (cr, lf) if index >= 0]
            if not ends:
                return events
            end = min(ends)
            if end == cr and end == len(self._buffer) - 1 and not final:
                return events  # a CR at the end may be the first half of CRLF: wait for the next piece
            skip = 2 if end == cr and self._buffer[end + 1 : end + 2] == b"\n" else 1
            line = bytes(self._buffer[:end])
            del self._buffer[: end + skip]
            event = self._line(line)
            if event is not None:
                events.append(event)

    def _line(self, raw: bytes) -> tuple[str, str] | None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            shown = excerpt(raw.decode("utf-8", "replace"), _EXCERPT_CHARS)
            raise _StreamError(f"line is not UTF-8: {shown!r}") from None
        if not line:
            if not self._data:
                self._event_type = ""
                return None
            event = (self._event_type or "message", "\n".join(self._data))
            self._event_type, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event_type = value
        return None


@dataclass
class _ToolCallParts:
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: list[str] = field(default_factory=list)


@dataclass
class _ChoiceParts:
    role: str | None = None
    content: list[str] | None = None
    reasoning_content: list[str] | None = None
    refusal: list[str] | None = None
    tool_calls: dict[int, _ToolCallParts] = field(default_factory=dict)
    finish_reason: object = None


class _StreamAssembler:
    """Turns ``chat.completion.chunk`` events into one ``chat.completion`` document."""

    def __init__(self, started: float) -> None:
        self._started = started
        self._parser = _SSEParser()
        self._header: dict[str, object] = {}
        self._choices: dict[int, _ChoiceParts] = {}
        self._usage: object = None
        self._nvext: dict[str, object] | None = None
        self.done = False
        self.ttft_s: float | None = None

    def feed(self, piece: bytes) -> None:
        for event in self._parser.feed(piece):
            self._event(*event)

    def finish(self) -> None:
        for event in self._parser.finish():
            self._event(*event)

    def _event(self, event_type: str, data: str) -> None:
        if self.done:
            return  # anything after [DONE] is not part of the answer
        if event_type == "error":
            raise _StreamError(f"server sent an error event: {excerpt(data, _EXCERPT_CHARS)!r}")
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            # Python's json keeps big integers exact, so u64 worker ids survive the round trip.
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            raise _StreamError(f"data is not JSON: {excerpt(data, _EXCERPT_CHARS)!r}") from None
        if not isinstance(chunk, dict):
            raise _StreamError(f"data is not a JSON object: {excerpt(data, _EXCERPT_CHARS)!r}")
        if "error" in chunk and not chunk.get("choices"):
            # OpenAI-compatible servers report a failure mid-stream as a data chunk with an error object.
            raise _StreamError(f"server sent an error chunk: {excerpt(data, _EXCERPT_CHARS)!r}")
        self._chunk(chunk)

    def _chunk(self, chunk: dict[str, object]) -> None:
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in self._header:
                self._header[key] = chunk[key]
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]  # usage is cumulative: the last one carried is the total
        nvext = chunk.get("nvext")
        if isinstance(nvext, dict):
            self._nvext = _merged(self._nvext or {}, nvext)
        choices = chunk.get("choices")
        if choices is None:
            return
        if not isinstance(choices, list):
            raise _StreamError(f"chunk choices is not an array: {excerpt(json.dumps(choices), _EXCERPT_CHARS)}")
        for choice in choices:
            if not isinstance(choice, dict):
                raise _StreamError(f"chunk choice is not an object: {excerpt(json.dumps(choice), _EXCERPT_CHARS)}")
            self._choice(choice)

    def _choice(self, choice: dict[str, object]) -> None:
        index = choice.get("index", 0)
        if not isinstance(index, int) or isinstance(index, bool):
            raise _StreamError(f"chunk choice index is {excerpt(json.dumps(index), _EXCERPT_CHARS)}, not an integer")
        parts = self._choices.setdefault(index, _ChoiceParts())
        if choice.get("finish_reason") is not None:
            parts.finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("role"), str):
            parts.role = str(delta["role"])
        produced = False
        for key in ("content", "reasoning_content", "refusal"):
            text = delta.get(key)
            if isinstance(text, str):
                pieces = getattr(parts, key)
                if pieces is None:
                    pieces = []
                    setattr(parts, key, pieces)
                pieces.append(text)
                produced = produced or bool(text)
        tool_calls = delta.get("tool_calls")
        if isinstance(tool_calls, list):
            produced = self._tool_calls(parts, tool_calls) or produced
        # TTFT counts any generated text, so a reasoning model's first thought or a tool call's first
        # argument byte is its first token too; the role-only opening chunk is not.
        if produced and self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self._started

    @staticmethod
    def _tool_calls(parts: _ChoiceParts, tool_calls: list[object]) -> bool:
        produced = False
        for position, call in enumerate(tool_calls):
            if not isinstance(call, dict):
                continue
            index = call.get("index", position)
            if not isinstance(index, int) or isinstance(index, bool):
                index = position
            entry = parts.tool_calls.setdefault(index, _ToolCallParts())
            if isinstance(call.get("id"), str):
                entry.id = str(call["id"])
            if isinstance(call.get("type"), str):
                entry.type = str(call["type"])
            function = call.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    entry.name = str(function["name"])
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    entry.arguments.append(arguments)
                    produced = produced or bool(arguments)
        return produced

    def document(self) -> dict[str, object]:
        """The assembled non-streaming response."""
        document: dict[str, object] = {**self._header, "object": "chat.completion"}
        document["choices"] = [self._assembled_choice(i, self._choices[i]) for i in sorted(self._choices)]
        if self._usage is not None:
            document["usage"] = self._usage
        if self._nvext is not None:
            document["nvext"] = self._nvext
        return document

    def body(self) -> bytes:
        return json.dumps(self.document()).encode("utf-8")

    @staticmethod
    def _assembled_choice(index: int, parts: _ChoiceParts) -> dict[str, object]:
        message: dict[str, object] = {
            "role": parts.role or "assistant",
            "content": None if parts.content is None else "".join(parts.content),
        }
        if parts.reasoning_content is not None:
            message["reasoning_content"] = "".join(parts.reasoning_content)
        if parts.refusal is not None:
            message["refusal"] = "".join(parts.refusal)
        if parts.tool_calls:
            message["tool_calls"] = [
                {
                    "index": call_index,
                    "id": call.id,
                    "type": call.type or "function",
                    "function": {"name": call.name, "arguments": "".join(call.arguments)},
                }
                for call_index, call in sorted(parts.tool_calls.items())
            ]
        return {"index": index, "message": message, "finish_reason": parts.finish_reason}


def _merged(base: dict[str, object], update: dict[str, object]) -> dict[str, object]:
    """Recursive dict merge, later values winning: a server may spread nvext fields over several chunks."""
    result = dict(base)
    for key, value in update.items():
        current = result.get(key)
        if isinstance(current, dict) and isinstance(value, dict):
            result[key] = _merged(current, value)
        else:
            result[key] = value
    return result
