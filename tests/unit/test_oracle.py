"""The equivalence oracle's request, parsing, comparison and near-tie rule (`matrix.check.oracle`).

The answers are in the shape vLLM's OpenAI completions API documents for `logprobs=N` with
`return_tokens_as_token_ids=true`: `choices[0].logprobs` holds `tokens` ("token_id:N"), `token_logprobs`,
`top_logprobs` (one object per token, keys "token_id:N", the sampled token included) and `text_offset`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from matrix.check.oracle import (
    CHECK_NAME,
    Completion,
    compare,
    judge,
    oracle_prompts,
    parse_completion,
    payload,
    summary,
)
from matrix.check.specs import DEFAULT_NEAR_TIE_GAP, OracleSpec


def vllm_completion(tokens: list[int], tops: list[dict[int, float]], *, as_ids: bool = True) -> bytes:
    """A completions answer as vLLM writes it (fields of vllm.entrypoints.openai.protocol.CompletionResponse)."""

    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids else f"w{t}"

    return json.dumps(
        {
            "id": "cmpl-3f2a9c1e5b8d4f7a",
            "object": "text_completion",
            "created": 1764540000,
            "model": "matrix-tiny-random",
            "choices": [
                {
                    "index": 0,
                    "text": " ".join(f"w{t}" for t in tokens),
                    "logprobs": {
                        "text_offset": list(range(0, 3 * len(tokens), 3)),
                        "token_logprobs": [max(top.values()) for top in tops],
                        "tokens": [name(t) for t in tokens],
                        "top_logprobs": [{name(t): lp for t, lp in top.items()} for top in tops],
                    },
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {"prompt_tokens": 12, "total_tokens": 12 + len(tokens), "completion_tokens": len(tokens)},
            "kv_transfer_params": None,
        }
    ).encode()


def completion(tokens: list[int], tops: list[dict[int, float]]) -> Completion:
    return parse_completion(vllm_completion(tokens, tops))


DECISIVE = [{5: -0.01, 9: -4.0}, {7: -0.02, 3: -5.0}, {8: -0.1, 2: -3.0}]


def test_payload_asks_for_greedy_token_ids_with_top2_logprobs() -> None:
    spec = OracleSpec(url="http://127.0.0.1:1/v1/completions", model="m", tokens=64, seed=7)
    body = payload(spec, "kalo mine")
    assert body["temperature"] == 0 and body["n"] == 1 and body["max_tokens"] == 64 and body["seed"] == 7
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True and body["ignore_eos"] is True
    assert body["prompt"] == "kalo mine" and body["stream"] is False


def test_parses_vllm_token_ids_and_ranks_top_logprobs() -> None:
    # vLLM lists the sampled token in top_logprobs as well; key order says nothing, values rank them.
    parsed = completion([5, 7, 8], [{9: -4.0, 5: -0.01}, {7: -0.02, 3: -5.0}, {2: -3.0, 8: -0.1, 4: -6.0}])
    assert parsed.token_ids == (5, 7, 8)
    assert parsed.top[0] == ((5, -0.01), (9, -4.0))
    assert parsed.top[2][0] == (8, -0.1) and len(parsed.top[2]) == 3
    assert parsed.text == "w5 w7 w8"


def test_an_engine_that_ignores_return_tokens_as_token_ids_is_named() -> None:
    with pytest.raises(ValueError, match="ignored return_tokens_as_token_ids"):
        parse_completion(vllm_completion([5], [{5: -0.1}], as_ids=False))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "not JSON"),
        (b'{"choices": []}', "no single choice"),
        (b'{"choices": [{"text": "x", "logprobs": null}]}', "ignored logprobs"),
        (
            b'{"choices": [{"logprobs": {"tokens": ["token_id:1"], "top_logprobs": []}}]}',
            "not one entry per token",
        ),
    ],
)
def test_unusable_answers_say_what_is_missing(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_completion(body)


def test_identical_token_ids_are_identical() -> None:
    a, b = completion([5, 7, 8], DECISIVE), completion([5, 7, 8], DECISIVE)
    result = compare(0, "p", a, b, DEFAULT_NEAR_TIE_GAP)
    assert result.kind == "identical" and result.divergence_at is None
    assert judge([result]) == []


def test_a_divergence_at_a_decisive_position_is_real_and_fails_with_both_continuations() -> None:
    agg = completion([5, 7, 8], DECISIVE)
    pd = completion([5, 3, 1], DECISIVE)  # position 1: aggregated 7 by 4.98 nats, the pair took 3
    result = compare(3, "kalo mine", pd, agg, DEFAULT_NEAR_TIE_GAP)
    assert (result.kind, result.divergence_at) == ("divergence", 1)
    assert result.gap == pytest.approx(4.98)
    (failure,) = judge([result])
    assert failure.name == CHECK_NAME
    assert "prompt 3 ('kalo mine') diverges at token 1" in failure.message
    assert "P/D [3, 1]" in failure.message and "aggregated [7, 8]" in failure.message


def test_a_near_tie_is_the_runner_up_within_the_gap_and_does_not_fail() -> None:
    tops = [{5: -0.01, 9: -4.0}, {7: -0.70, 3: -0.72, 4: -2.0}, {8: -0.1, 2: -3.0}]
    agg = completion([5, 7, 8], tops)
    result = compare(0, "p", completion([5, 3, 8], tops), agg, DEFAULT_NEAR_TIE_GAP)
    assert (result.kind, result.divergence_at) == ("near-tie", 1)
    assert judge([result]) == []
    # The same gap, but the pair took the third choice: not numerics flipping an argmax.
    third = compare(0, "p", completion([5, 4, 8], tops), agg, DEFAULT_NEAR_TIE_GAP)
    assert third.kind == "divergence"
    # A threshold below the gap makes the runner-up a real divergence too.
    assert compare(0, "p", completion([5, 3, 8], tops), agg, 0.01).kind == "divergence"


def test_a_shorter_answer_and_a_missing_answer_fail() -> None:
    agg = completion([5, 7, 8], DECISIVE)
    short = compare(0, "p", completion([5, 7], DECISIVE[:2]), agg, DEFAULT_NEAR_TIE_GAP)
    assert (short.kind, short.divergence_at) == ("divergence", 2)
    missing = compare(1, "p", "HTTP 500 from x", agg, DEFAULT_NEAR_TIE_GAP)
    assert missing.kind == "error" and "P/D: HTTP 500" in missing.error
    failures = judge([short, missing])
    assert len(failures) == 1 and "prompt 1: no comparison" in failures[0].message
    assert summary([short, missing]).startswith("0/2 prompts token-identical")


def test_oracle_prompts_are_deterministic_distinct_and_in_the_tiny_vocabulary() -> None:
    prompts = oracle_prompts(16)
    assert prompts == oracle_prompts(16) and len(set(prompts)) == 16
    assert prompts != oracle_prompts(16, seed=1)
    from matrix.model_files import tokenizer_json

    vocab: dict[str, Any] = tokenizer_json(4096)["model"]["vocab"]
    for prompt in prompts:
        words = prompt.split()
        assert 8 <= len(words) <= 48
        assert all(word in vocab for word in words), prompt  # no <unk>: every KV position is a real token
