"""Named checks on chat-completion bodies: each check alone, several at once, lossless u64 ids."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from matrix.check.validate import (
    CHECK_DESCRIPTIONS,
    CHECK_NAMES,
    CheckFailure,
    Validation,
    validate_chat_response,
)

BIG_ID = 15783270017955876104  # a real id from the field: above 2**63


def healthy() -> dict[str, Any]:
    """A response as a disaggregated Dynamo frontend returns it."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1764460800,
        "model": "Qwen/Qwen3-0.6B",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The KV cache moved from prefill to decode."},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 512, "completion_tokens": 64, "total_tokens": 576},
        "nvext": {"worker_id": {"prefill_worker_id": BIG_ID, "decode_worker_id": 7587892071539612425}},
    }


def encode(document: object) -> bytes:
    return json.dumps(document).encode()


def run(document: object, status: int | None = 200) -> Validation:
    return validate_chat_response(status, encode(document))


def names(validation: Validation) -> list[str]:
    return [failure.name for failure in validation.failures]


def test_check_names_are_documented_and_ordered() -> None:
    assert CHECK_NAMES == (
        "http_status",
        "json_body",
        "one_choice",
        "content_nonblank",
        "finish_reason",
        "usage_object",
        "prompt_tokens",
        "completion_tokens",
        "worker_ids_present",
        "worker_ids_distinct",
    )
    assert all(CHECK_DESCRIPTIONS[name] for name in CHECK_NAMES)


def test_healthy_body_passes_and_reports_facts() -> None:
    result = run(healthy())
    assert result.ok
    assert result.failures == ()
    assert result.skipped == ()
    assert result.prefill_worker_id == BIG_ID
    assert result.decode_worker_id == 7587892071539612425
    assert result.prompt_tokens == 512
    assert result.completion_tokens == 64
    assert result.finish_reason == "length"
    assert result.content == "The KV cache moved from prefill to decode."


def test_content_is_whole_so_it_can_be_redacted_before_it_is_cut() -> None:
    # [M21] item 7: a cut at 200 characters before redaction left up to 7 characters of a token.
    doc = healthy()
    doc["choices"][0]["message"]["content"] = "x" * 300
    assert run(doc).content == "x" * 300


def mutate(path: str, value: object = ...) -> Callable[[dict[str, Any]], None]:
    """Set (or, with no value, delete) a dotted path such as ``usage.prompt_tokens``."""

    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is ...:
            del node[last]
        elif last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return apply


# Each mutation breaks exactly one check; the expected fragment shows the message says what was seen.
SINGLE_FAILURES = [
    ("one_choice", mutate("choices", []), "choices is empty"),
    ("one_choice", mutate("choices", ...), "choices is missing"),
    ("one_choice", mutate("choices", {"a": 1}), "(a object)"),
    ("content_nonblank", mutate("choices.0.message.content", "  \n\t"), 'content is "  \\n\\t" (a string)'),
    ("content_nonblank", mutate("choices.0.message.content", None), "content is null"),
    ("content_nonblank", mutate("choices.0.message", ...), "choices[0].message is missing"),
    ("finish_reason", mutate("choices.0.finish_reason", "error"), 'finish_reason is "error" (a string)'),
    ("finish_reason", mutate("choices.0.finish_reason", None), "finish_reason is null"),
    ("finish_reason", mutate("choices.0.finish_reason", ...), "finish_reason is missing"),
    ("prompt_tokens", mutate("usage.prompt_tokens", 0), "usage.prompt_tokens is 0; expected an integer > 0"),
    ("prompt_tokens", mutate("usage.prompt_tokens", True), "prompt_tokens is true (a boolean)"),
    ("prompt_tokens", mutate("usage.prompt_tokens", "512"), 'prompt_tokens is "512" (a string)'),
    ("prompt_tokens", mutate("usage.prompt_tokens", 512.0), "prompt_tokens is 512.0 (a number)"),
    (
        "completion_tokens",
        mutate("usage.completion_tokens", 1),
        "completion_tokens is 1; decode must produce more than the 1 token prefill makes",
    ),
    ("completion_tokens", mutate("usage.completion_tokens", True), "completion_tokens is true (a boolean)"),
    ("completion_tokens", mutate("usage.completion_tokens", ...), "completion_tokens is missing"),
    ("worker_ids_present", mutate("nvext", ...), "nvext is missing"),
    ("worker_ids_present", mutate("nvext.worker_id", ...), "nvext.worker_id is missing"),
    ("worker_ids_present", mutate("nvext.worker_id.decode_worker_id", ...), "decode_worker_id is missing"),
    ("worker_ids_present", mutate("nvext.worker_id.prefill_worker_id", -1), "prefill_worker_id is -1"),
    ("worker_ids_present", mutate("nvext.worker_id.prefill_worker_id", 2**64), str(2**64)),
    ("worker_ids_present", mutate("nvext.worker_id.prefill_worker_id", False), "is false (a boolean)"),
    ("worker_ids_present", mutate("nvext.worker_id.prefill_worker_id", str(BIG_ID)), "(a string)"),
    (
        "worker_ids_distinct",
        mutate("nvext.worker_id.decode_worker_id", BIG_ID),
        f"prefill_worker_id and decode_worker_id are both {BIG_ID}: one worker served both phases (aggregated?)",
    ),
]


@pytest.mark.parametrize(
    ("check", "breaker", "fragment"),
    SINGLE_FAILURES,
    ids=[f"{check}-{i}" for i, (check, _, _) in enumerate(SINGLE_FAILURES)],
)
def test_each_check_fails_alone(check: str, breaker: Callable[[dict[str, Any]], None], fragment: str) -> None:
    doc = healthy()
    breaker(doc)
    result = run(doc)
    assert not result.ok
    assert names(result) == [check]
    assert fragment in result.failures[0].message


def test_usage_object_fails_alone_and_skips_token_checks() -> None:
    usages: list[object] = [None, [], "64"]
    for usage in usages:
        doc = healthy()
        doc["usage"] = usage
        result = run(doc)
        assert names(result) == ["usage_object"]
        assert result.skipped == ("prompt_tokens", "completion_tokens")
    doc = healthy()
    del doc["usage"]
    assert run(doc).failures == (
        CheckFailure("usage_object", "usage is missing; expected an object with token counts"),
    )


def test_many_independent_failures_are_all_reported() -> None:
    doc = healthy()
    del doc["usage"]
    doc["choices"][0]["finish_reason"] = "abort"
    doc["choices"][0]["message"]["content"] = ""
    doc["nvext"]["worker_id"]["decode_worker_id"] = BIG_ID
    result = run(doc)
    assert names(result) == ["content_nonblank", "finish_reason", "usage_object", "worker_ids_distinct"]
    assert result.skipped == ("prompt_tokens", "completion_tokens")
    # Facts are still extracted next to the failures.
    assert result.prefill_worker_id == result.decode_worker_id == BIG_ID
    assert result.finish_reason == "abort"


def test_every_body_check_fails_at_once() -> None:
    doc = {"choices": [{"message": {"content": " "}, "finish_reason": "tool"}, {}], "usage": {}, "nvext": {}}
    result = run(doc)
    assert names(result) == [
        "one_choice",
        "content_nonblank",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "worker_ids_present",
    ]
    assert "choices has 2 entries; expected exactly 1" in result.failures[0].message
    assert result.skipped == ("worker_ids_distinct",)


def test_both_worker_ids_bad_are_reported_in_one_failure() -> None:
    doc = healthy()
    doc["nvext"]["worker_id"] = {"prefill_worker_id": None, "decode_worker_id": -5}
    result = run(doc)
    assert names(result) == ["worker_ids_present"]
    message = result.failures[0].message
    assert "prefill_worker_id is null" in message
    assert "decode_worker_id is -5" in message
    assert result.prefill_worker_id is None


@pytest.mark.parametrize("worker_id", [BIG_ID, 2**64 - 1, 2**63, 0])
def test_u64_ids_are_lossless(worker_id: int) -> None:
    # Written as raw JSON text, so no float ever touches the number.
    body = (
        b'{"choices":[{"message":{"content":"hi there"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":2},'
        b'"nvext":{"worker_id":{"prefill_worker_id":%d,"decode_worker_id":%d}}}' % (worker_id, worker_id ^ 1)
    )
    result = validate_chat_response(200, body)
    assert result.ok, result.failures
    assert result.prefill_worker_id == worker_id
    assert result.decode_worker_id == worker_id ^ 1
    assert type(result.prefill_worker_id) is int


def test_same_big_ids_message_is_exact() -> None:
    doc = healthy()
    doc["nvext"]["worker_id"]["decode_worker_id"] = BIG_ID
    assert run(doc).failures == (
        CheckFailure(
            "worker_ids_distinct",
            "prefill_worker_id and decode_worker_id are both 15783270017955876104: one worker served both "
            "phases (aggregated?)",
        ),
    )


def test_bool_is_not_an_int_anywhere() -> None:
    doc = healthy()
    doc["usage"] = {"prompt_tokens": True, "completion_tokens": True}
    doc["nvext"]["worker_id"] = {"prefill_worker_id": True, "decode_worker_id": False}
    result = run(doc)
    assert names(result) == ["prompt_tokens", "completion_tokens", "worker_ids_present"]
    assert result.prompt_tokens is None
    assert result.completion_tokens is None
    assert result.prefill_worker_id is None


@pytest.mark.parametrize(
    ("message", "excerpt"),
    [
        ({"content": None, "reasoning_content": "Let me think."}, "Let me think."),
        ({"content": "", "refusal": "I can't help with that."}, "I can't help with that."),
        (
            {
                "content": None,
                "tool_calls": [
                    {"id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}},
                    {"id": "c1", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
                ],
            },
            '{"x": 1}',
        ),
        ({"content": "answer", "reasoning_content": "thought"}, "answer"),
    ],
)
def test_content_fallbacks(message: dict[str, Any], excerpt: str) -> None:
    doc = healthy()
    doc["choices"][0]["message"] = message
    result = run(doc)
    assert result.ok, result.failures
    assert result.content == excerpt


def test_content_blank_everywhere_lists_what_was_seen() -> None:
    doc = healthy()
    doc["choices"][0]["message"] = {
        "content": " ",
        "reasoning_content": None,
        "tool_calls": [{"function": {"arguments": "  "}}],
    }
    result = run(doc)
    assert names(result) == ["content_nonblank"]
    message = result.failures[0].message
    assert 'content is " " (a string)' in message
    assert "reasoning_content is null" in message
    assert "refusal is missing" in message
    assert "1 tool call(s) without non-blank arguments" in message


def test_non_200_skips_everything_and_shows_escaped_excerpt() -> None:
    body = b'{"error": "no prefill worker"}\n' + b"\x00" * 5 + b"y" * 400
    result = validate_chat_response(503, body)
    assert names(result) == ["http_status"]
    assert result.skipped == CHECK_NAMES[1:]
    message = result.failures[0].message
    assert message.startswith('HTTP status is 503; expected 200; body starts \'{"error": "no prefill worker"}\\n')
    assert "\\x00" in message
    assert "\n" not in message
    assert f"({len(body)} bytes in all)" in message
    # 300 characters of body plus quoting and prose, not the whole body.
    assert len(message) < 400


def test_non_200_with_a_valid_body_still_fails() -> None:
    result = run(healthy(), status=500)
    assert names(result) == ["http_status"]
    assert result.prefill_worker_id is None


def test_no_response_at_all() -> None:
    result = validate_chat_response(None, b"")
    assert result.failures == (CheckFailure("http_status", "no HTTP response arrived; expected 200; body is empty"),)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "body is empty"),
        (b"   ", "body is empty"),
        (b"<html>502 Bad Gateway</html>", "body is not JSON"),
        (b'{"choices": [', "body is not JSON"),
        (b"\xff\xfe\x00garbage", "body is not JSON"),
        (b"[1, 2]", "body is a JSON array, not an object"),
        (b'"ok"', "body is a JSON string, not an object"),
        (b"null", "body is a JSON null, not an object"),
        (b"[" * 100_000 + b"]" * 100_000, "body is not JSON (nested too deeply)"),
    ],
)
def test_non_json_fails_json_body_and_skips_the_rest(body: bytes, fragment: str) -> None:
    result = validate_chat_response(200, body)
    assert names(result) == ["json_body"]
    assert fragment in result.failures[0].message
    assert result.skipped == CHECK_NAMES[2:]


def test_failure_names_are_always_known_checks() -> None:
    doc = {"choices": "x", "usage": 1, "nvext": {"worker_id": []}}
    result = run(doc)
    assert set(names(result)) <= set(CHECK_NAMES)
    assert set(result.skipped) <= set(CHECK_NAMES)
    assert not set(names(result)) & set(result.skipped)


def test_validation_does_not_modify_input_and_is_repeatable() -> None:
    doc = healthy()
    before = copy.deepcopy(doc)
    assert run(doc) == run(doc)
    assert doc == before


