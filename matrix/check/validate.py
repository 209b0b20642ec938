"""Named checks on a disaggregated chat completion (the answer to `matrix.check.client.build_payload`).

Every check is an explicit comparison that records a `CheckFailure`; nothing here uses ``assert``, which
``python -O`` strips. All independent failures are reported, not only the first, so one run shows every
way a cell is broken (e.g. missing usage *and* equal worker ids *and* a bad finish reason). A check whose
input does not exist (no choice, no usage object, no body at all) is skipped rather than failed twice;
`Validation.skipped` names those checks.

Messages say what was seen, so a report is readable without the raw body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeGuard

from matrix.check.specs import CheckFailure
from matrix.text import excerpt

__all__ = [
    "CHECK_DESCRIPTIONS",
    "CHECK_NAMES",
    "CheckFailure",
    "Validation",
    "validate_chat_response",
]

# Worker ids are unsigned 64-bit integers; real ids exceed 2**63 (e.g. 15783270017955876104).
_U64_LIMIT = 2**64
_FINISH_REASONS = ("stop", "length")
_BODY_EXCERPT_CHARS = 300
_VALUE_REPR_CHARS = 80

CHECK_DESCRIPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "http_status": "the frontend answered HTTP 200",
        "json_body": "the body parses as a JSON object",
        "one_choice": "choices holds exactly one choice object (the request asks for n=1)",
        "content_nonblank": (
            "the choice's message has non-blank text: content, else reasoning_content, refusal, "
            "or tool_calls[].function.arguments"
        ),
        "finish_reason": "the choice's finish_reason is 'stop' or 'length'",
        "usage_object": "usage is a JSON object",
        "prompt_tokens": "usage.prompt_tokens is an integer > 0",
        "completion_tokens": (
            "usage.completion_tokens is an integer > 1: decode produced more than the one token prefill makes"
        ),
        "worker_ids_present": ("nvext.worker_id.prefill_worker_id and .decode_worker_id are integers in [0, 2**64)"),
        "worker_ids_distinct": (
            "prefill and decode worker ids differ (an aggregated deployment returns the same id twice)"
        ),
    }
)
"""Every check name with a one-line description of what passing means, in evaluation order."""

CHECK_NAMES: tuple[str, ...] = tuple(CHECK_DESCRIPTIONS)
"""Every check name, in evaluation order (see `CHECK_DESCRIPTIONS` for what each one demands)."""


@dataclass(frozen=True)
class Validation:
    """The outcome of validating one response, plus the facts a report shows next to it.

    The facts are filled whenever the body carries them, even when a check on them failed (a
    ``completion_tokens`` of 1 is still recorded as 1), so reports can show what the server said.
    Worker ids are Python ints: lossless for the full u64 range.
    """

    failures: tuple[CheckFailure, ...]
    prefill_worker_id: int | None
    decode_worker_id: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    finish_reason: str | None
    # The answer's text, whole: whoever shows it redacts it first and only then cuts it to an excerpt, so
    # a secret cut in half can never keep the part the redaction would have recognised.
    content: str | None
    # Checks not evaluated because what they inspect does not exist (e.g. everything after a non-200).
    skipped: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when no check failed."""
        return not self.failures

    @property
    def failed_names(self) -> tuple[str, ...]:
        """Names of the failed checks, in evaluation order."""
        return tuple(failure.name for failure in self.failures)


def _is_int(value: object) -> TypeGuard[int]:
    # bool is a subclass of int in Python, but JSON `true` is not a token count or a worker id.
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: object) -> str:
    """A short rendering of a JSON value as JSON (escaped, ASCII-only), with its type unless an int."""
    if value is None:
        return "null"
    text = excerpt(json.dumps(value), _VALUE_REPR_CHARS)
    if _is_int(value):
        return text
    return f"{text} (a {_json_type(value)})"


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null" if value is None else type(value).__name__


def _seen(container: Mapping[str, object], key: str, where: str) -> str:
    """``"<where>.<key> is <value>"``, or ``"... is missing"`` when the key is absent."""
    if key not in container:
        return f"{where}{key} is missing"
    return f"{where}{key} is {_describe(container[key])}"


def _body_excerpt(body: bytes) -> str:
    """The first characters of a body, redacted and escaped: safe to print whatever the server sent.

    The whole body is redacted before the cut (`excerpt`): a secret echoed across the cut would otherwise
    keep its first half, which no rule recognises. The cut comes before repr() so it never lands inside
    an escape sequence.
    """
    if not body:
        return "body is empty"
    text = body.decode("utf-8", errors="replace")
    kept = excerpt(text, _BODY_EXCERPT_CHARS)
    if len(text) > _BODY_EXCERPT_CHARS:
        return f"body starts {kept!r} ({len(body)} bytes in all)"
    return f"body {kept!r}"


class _Collector:
    """Accumulates failures and skipped checks in evaluation order."""

    def __init__(self) -> None:
        self.failures: list[CheckFailure] = []
        self.skipped: list[str] = []

    def fail(self, name: str, message: str) -> None:
        self.failures.append(CheckFailure(name, message))

    def skip(self, *names: str) -> None:
        self.skipped.extend(names)


def validate_chat_response(status_code: int | None, body: bytes) -> Validation:
    """Run every check on one chat-completion response and return all failures.

    `status_code` is None when no HTTP response arrived at all. `body` is the raw (or, for a stream, the
    assembled non-streaming) response body. A non-200 or non-JSON body makes every later check impossible,
    so those are skipped; past that point, each check runs if its own input exists.
    """
    out = _Collector()
    facts: dict[str, object] = {}

    if status_code != 200:
        seen = "no HTTP response arrived" if status_code is None else f"HTTP status is {status_code}"
        out.fail("http_status", f"{seen}; expected 200; {_body_excerpt(body)}")
        out.skip(*CHECK_NAMES[1:])
        return _result(out, facts)

    document = _parse_object(body, out)
    if document is None:
        out.skip(*CHECK_NAMES[2:])
        return _result(out, facts)

    _check_choice(document, out, facts)
    _check_usage(document, out, facts)
    _check_worker_ids(document, out, facts)
    return _result(out, facts)


def _result(out: _Collector, facts: Mapping[str, object]) -> Validation:
    def as_int(key: str) -> int | None:
        value = facts.get(key)
        return value if isinstance(value, int) else None

    def as_str(key: str) -> str | None:
        value = facts.get(key)
        return value if isinstance(value, str) else None

    return Validation(
        failures=tuple(out.failures),
        prefill_worker_id=as_int("prefill_worker_id"),
        decode_worker_id=as_int("decode_worker_id"),
        prompt_tokens=as_int("prompt_tokens"),
        completion_tokens=as_int("completion_tokens"),
        finish_reason=as_str("finish_reason"),
        content=as_str("content"),
        skipped=tuple(out.skipped),
    )


def _parse_object(body: bytes, out: _Collector) -> dict[str, object] | None:
    """The body as a JSON object, or None after recording a `json_body` failure.

    Python's json keeps integers as exact ints of any size, so u64 worker ids survive unchanged.
    """
    if not body.strip():
        out.fail("json_body", "body is empty; expected a JSON object")
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, invalid UTF-8 and over-long integer literals; RecursionError
        # a pathologically nested body. Either way the server did not send usable JSON.
        reason = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        out.fail("json_body", f"body is not JSON ({reason}); {_body_excerpt(body)}")
        return None
    if not isinstance(document, dict):
        out.fail("json_body", f"body is a JSON {_json_type(document)}, not an object; {_body_excerpt(body)}")
        return None
    return document


def _check_choice(document: Mapping[str, object], out: _Collector, facts: dict[str, object]) -> None:
    """`one_choice`, then `content_nonblank` and `finish_reason` on that choice."""
    choices = document.get("choices")
    choice: Mapping[str, object] | None = None
    if not isinstance(choices, list):
        out.fail("one_choice", f"{_seen(document, 'choices', '')}; expected an array with one choice")
    elif not choices:
        out.fail("one_choice", "choices is empty; expected exactly one choice")
    elif not isinstance(choices[0], dict):
        out.fail("one_choice", f"choices[0] is {_describe(choices[0])}; expected a choice object")
    else:
        choice = choices[0]
        if len(choices) != 1:
            # The first choice is still checked below: more information, and it is what a client shows.
            out.fail("one_choice", f"choices has {len(choices)} entries; expected exactly 1 (n=1)")

    if choice is None:
        out.skip("content_nonblank", "finish_reason")
        return
    _check_content(choice, out, facts)

    finish = choice.get("finish_reason")
    if isinstance(finish, str):
        facts["finish_reason"] = finish
    if finish not in _FINISH_REASONS:
        out.fail(
            "finish_reason",
            f"{_seen(choice, 'finish_reason', 'choices[0].')}; expected 'stop' or 'length'",
        )


def _check_content(choice: Mapping[str, object], out: _Collector, facts: dict[str, object]) -> None:
    message = choice.get("message")
    if not isinstance(message, dict):
        out.fail(
            "content_nonblank",
            f"{_seen(choice, 'message', 'choices[0].')}; expected a message object with text",
        )
        return

    # Reasoning models may put all text in reasoning_content, a refusal in refusal, and a tool-calling
    # reply only in function arguments: each still proves decode generated text.
    candidates: list[tuple[str, object]] = [
        ("content", message.get("content")),
        ("reasoning_content", message.get("reasoning_content")),
        ("refusal", message.get("refusal")),
    ]
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for index, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            candidates.append((f"tool_calls[{index}].function.arguments", arguments))

    for _, value in candidates:
        if isinstance(value, str) and value.strip():
            facts["content"] = value
            return

    content = message.get("content")
    if isinstance(content, str):
        facts["content"] = content
    seen = [_seen(message, key, "") for key in ("content", "reasoning_content", "refusal")]
    seen.append(
        "no tool_calls"
        if not isinstance(tool_calls, list) or not tool_calls
        else f"{len(tool_calls)} tool call(s) without non-blank arguments"
    )
    out.fail("content_nonblank", f"no non-blank text in choices[0].message: {', '.join(seen)}")


def _check_usage(document: Mapping[str, object], out: _Collector, facts: dict[str, object]) -> None:
    """`usage_object`, then `prompt_tokens` and `completion_tokens` inside it."""
    usage = document.get("usage")
    if not isinstance(usage, dict):
        out.fail("usage_object", f"{_seen(document, 'usage', '')}; expected an object with token counts")
        out.skip("prompt_tokens", "completion_tokens")
        return

    prompt = usage.get("prompt_tokens")
    if _is_int(prompt):
        facts["prompt_tokens"] = prompt
    if not (_is_int(prompt) and prompt > 0):
        out.fail("prompt_tokens", f"{_seen(usage, 'prompt_tokens', 'usage.')}; expected an integer > 0")

    completion = usage.get("completion_tokens")
    if _is_int(completion):
        facts["completion_tokens"] = completion
    if not (_is_int(completion) and completion > 1):
        why = "decode must produce more than the 1 token prefill makes"
        # A too-small count gets the reason alone; any other value also needs the expected type.
        need = why if _is_int(completion) else f"expected an integer > 1 ({why})"
        out.fail("completion_tokens", f"{_seen(usage, 'completion_tokens', 'usage.')}; {need}")


def _check_worker_ids(document: Mapping[str, object], out: _Collector, facts: dict[str, object]) -> None:
    """`worker_ids_present`, then `worker_ids_distinct` when both ids are valid."""
    hint = "the request asks for worker ids with nvext.extra_fields=['worker_id']"
    nvext = document.get("nvext")
    if not isinstance(nvext, dict):
        out.fail("worker_ids_present", f"{_seen(document, 'nvext', '')}; expected an object ({hint})")
        out.skip("worker_ids_distinct")
        return
    worker = nvext.get("worker_id")
    if not isinstance(worker, dict):
        out.fail("worker_ids_present", f"{_seen(nvext, 'worker_id', 'nvext.')}; expected an object ({hint})")
        out.skip("worker_ids_distinct")
        return

    problems: list[str] = []
    ids: list[int] = []
    for key in ("prefill_worker_id", "decode_worker_id"):
        value = worker.get(key)
        if _is_int(value) and 0 <= value < _U64_LIMIT:
            facts[key] = value
            ids.append(value)
        else:
            problems.append(f"{_seen(worker, key, 'nvext.worker_id.')}; expected an integer in [0, 2**64)")
    if problems:
        out.fail("worker_ids_present", "; ".join(problems))
        out.skip("worker_ids_distinct")
        return

    prefill_id, decode_id = ids
    if prefill_id == decode_id:
        out.fail(
            "worker_ids_distinct",
            f"prefill_worker_id and decode_worker_id are both {prefill_id}: one worker served both phases "
            "(aggregated?)",
        )
