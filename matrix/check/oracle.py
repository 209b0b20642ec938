"""The equivalence oracle: a disaggregated deployment must produce the tokens an aggregated one produces.

A pair whose KV arrives but is wrong (wrong or stale blocks, a layout mismatch) still returns fluent text,
so every other check passes. Greedy decoding is deterministic, so the same engine, model, flags and seed,
served as one aggregated instance, must give the same token ids for the same prompt. `ask` sends K
prompts of T greedy tokens to one deployment (the OpenAI completions API with `logprobs=2` and
`return_tokens_as_token_ids`, as vLLM documents them; the reference server answers the same shape),
`compare` finds each prompt's first divergence, and `judge` turns the real ones into a `CheckFailure`.

Near-ties: where the aggregated run's top-1 and top-2 log-probabilities differ by less than the case's
threshold, and the pair chose exactly that runner-up, a difference in the last bits of arithmetic (another
kernel, another batch shape) can flip the argmax. That divergence is recorded as a near-tie and does not
fail the check; every other divergence does, with the prompt, the position and both continuations.

Prompts are sent one at a time, to both deployments in the same order, so batch composition is the same.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from matrix.check.http import loopback_client
from matrix.check.specs import CheckFailure, OracleSpec
from matrix.text import excerpt

__all__ = [
    "CHECK_NAME",
    "Completion",
    "PromptResult",
    "ask",
    "compare",
    "judge",
    "oracle_prompts",
    "parse_completion",
    "payload",
    "spec_prompts",
    "summary",
    "word",
]

CHECK_NAME = "equivalent_to_aggregated"
TOKEN_ID_PREFIX = "token_id:"  # noqa: S105 (vLLM's spelling of a token id, not a secret)
MAX_RESPONSE_BYTES = 4 * 1024 * 1024
# The tiny model's word-level vocabulary (`matrix.model_files`) spells token id i (7 <= i < 4096) in these
# syllables, least significant first; prompts made of ids 7..255 have no <unk>, so every position of the KV
# cache carries a distinct token.
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du", "ga", "zo", "fi", "hu", "be", "ya")
_SHOWN_TOKENS = 12


def oracle_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts of 8 to 48 words, the same for any run with the same seed."""
    rng = random.Random(f"matrix-oracle-{seed}")
    prompts: list[str] = []
    while len(prompts) < count:
        words = [_word(rng.randint(7, 255)) for _ in range(rng.randint(8, 48))]
        text = " ".join(words)
        if text not in prompts:
            prompts.append(text)
    return prompts


def spec_prompts(spec: OracleSpec) -> list[str]:
    """Every prompt `spec` asks, in order: the generated ones, then its extra (a traffic profile's) ones."""
    return oracle_prompts(spec.prompts, spec.seed) + list(spec.extra_prompts)


def word(index: int) -> str:
    """Token id `index` of the tiny model's vocabulary spelt as its word (7 <= index < 4096)."""
    return _word(index)


def _word(index: int) -> str:
    high, low = divmod(index, len(_SYLLABLES))
    return _SYLLABLES[low] + (_SYLLABLES[high] if high else "")


def payload(spec: OracleSpec, prompt: str) -> dict[str, Any]:
    """A greedy completion of exactly `spec.tokens` token ids, with the top-2 log-probabilities of each."""
    return {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.tokens,
        "temperature": 0,
        "n": 1,
        "seed": spec.seed,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        # Same length on both sides: a random model may emit EOS anywhere.
        "ignore_eos": True,
        "stream": False,
    }


@dataclass(frozen=True)
class Completion:
    """One deployment's answer to one prompt: token ids and, per position, the top log-probabilities."""

    token_ids: tuple[int, ...]
    # Per position: (token id, logprob) pairs, best first.
    top: tuple[tuple[tuple[int, float], ...], ...]
    text: str = ""


def _token_id(text: object, where: str) -> int:
    if not isinstance(text, str) or not text.startswith(TOKEN_ID_PREFIX):
        raise ValueError(
            f"{where} is {text!r}, not 'token_id:N': the engine ignored return_tokens_as_token_ids "
            "(token ids, not text, are what the oracle compares)"
        )
    try:
        return int(text[len(TOKEN_ID_PREFIX) :])
    except ValueError:
        raise ValueError(f"{where} is {text!r}, not 'token_id:N'") from None


def parse_completion(body: bytes) -> Completion:
    """Token ids and top log-probabilities from a completions answer; ValueError says what is missing."""
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the answer is not JSON: {exc}") from None
    choices = document.get("choices") if isinstance(document, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ValueError("the answer has no single choice")
    logprobs = choices[0].get("logprobs")
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
        raise ValueError("the choice has no logprobs.tokens: the engine ignored logprobs=2")
    ids = tuple(_token_id(t, f"logprobs.tokens[{i}]") for i, t in enumerate(logprobs["tokens"]))
    raw_top = logprobs.get("top_logprobs")
    if not isinstance(raw_top, list) or len(raw_top) != len(ids):
        raise ValueError("logprobs.top_logprobs is missing or not one entry per token")
    top: list[tuple[tuple[int, float], ...]] = []
    for i, entry in enumerate(raw_top):
        pairs: Any = [] if entry is None else entry.items() if isinstance(entry, dict) else None
        if pairs is None:
            raise ValueError(f"logprobs.top_logprobs[{i}] is not an object")
        ranked = sorted(
            ((_token_id(k, f"logprobs.top_logprobs[{i}] key"), float(v)) for k, v in pairs),
            key=lambda pair: -pair[1],
        )
        top.append(tuple(ranked))
    text = choices[0].get("text")
    return Completion(ids, tuple(top), text if isinstance(text, str) else "")


def ask(spec: OracleSpec, prompts: list[str], client: httpx.Client | None = None) -> list[Completion | str]:
    """Each prompt's completion, or a string saying why there is none (transport, status, shape)."""
    http = client or loopback_client(spec.timeout_s)
    try:
        return [_ask_one(http, spec, prompt) for prompt in prompts]
    finally:
        if client is None:
            http.close()


def _ask_one(http: httpx.Client, spec: OracleSpec, prompt: str) -> Completion | str:
    try:
        with http.stream("POST", spec.url, json=payload(spec, prompt), timeout=spec.timeout_s) as response:
            body = bytearray()
            for piece in response.iter_bytes():
                body += piece
                if len(body) > MAX_RESPONSE_BYTES:
                    return f"answer exceeded {MAX_RESPONSE_BYTES} bytes"
            status = response.status_code
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__} on {spec.url}: {exc}"
    if status != 200:
        return f"HTTP {status} from {spec.url}: {excerpt(bytes(body).decode('utf-8', 'replace'), 300)}"
    try:
        return parse_completion(bytes(body))
    except ValueError as exc:
        return str(exc)


Kind = Literal["identical", "near-tie", "divergence", "error"]


@dataclass(frozen=True)
class PromptResult:
    """One prompt compared: where the pair first left the aggregated run's tokens, and why."""

    index: int
    prompt: str
    kind: Kind
    # First position where the token ids differ (None when identical or when an answer is missing).
    divergence_at: int | None = None
    # The aggregated run's top-1 minus top-2 logprob at that position (None when it lists fewer than 2).
    gap: float | None = None
    pd_token_ids: list[int] = field(default_factory=list)
    aggregated_token_ids: list[int] = field(default_factory=list)
    pd_text: str = ""
    aggregated_text: str = ""
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(index: int, prompt: str, pd: Completion | str, agg: Completion | str, near_tie_gap: float) -> PromptResult:
    """Compare one prompt's two answers token id by token id; classify the first divergence."""
    if isinstance(pd, str) or isinstance(agg, str):
        error = "; ".join(f"{who}: {e}" for who, e in (("P/D", pd), ("aggregated", agg)) if isinstance(e, str))
        return PromptResult(index, prompt, "error", error=error)
    common: dict[str, Any] = {
        "pd_token_ids": list(pd.token_ids),
        "aggregated_token_ids": list(agg.token_ids),
        "pd_text": pd.text,
        "aggregated_text": agg.text,
    }
    at = next((i for i, (a, b) in enumerate(zip(pd.token_ids, agg.token_ids, strict=False)) if a != b), None)
    if at is None:
        if len(pd.token_ids) == len(agg.token_ids):
            return PromptResult(index, prompt, "identical", **common)
        # One is a prefix of the other: a length difference is never numerics.
        return PromptResult(index, prompt, "divergence", min(len(pd.token_ids), len(agg.token_ids)), **common)
    top = agg.top[at] if at < len(agg.top) else ()
    gap = top[0][1] - top[1][1] if len(top) >= 2 else None
    # A near-tie: the aggregated run nearly chose what the pair chose, and the pair chose its runner-up.
    near = gap is not None and gap < near_tie_gap and pd.token_ids[at] == top[1][0] and agg.token_ids[at] == top[0][0]
    return PromptResult(index, prompt, "near-tie" if near else "divergence", at, gap, **common)


def _shown(ids: list[int], start: int) -> str:
    part = ids[start : start + _SHOWN_TOKENS]
    return "[" + ", ".join(map(str, part)) + (", ..." if len(ids) > start + _SHOWN_TOKENS else "") + "]"


def summary(results: list[PromptResult]) -> str:
    """One line: how many prompts were token-identical, near-ties, real divergences, errors."""
    counts = {kind: sum(r.kind == kind for r in results) for kind in ("identical", "near-tie", "divergence", "error")}
    return (
        f"{counts['identical']}/{len(results)} prompts token-identical to aggregated, {counts['near-tie']} near-tie, "
        f"{counts['divergence']} real divergence, {counts['error']} without an answer"
    )


def judge(results: list[PromptResult]) -> list[CheckFailure]:
    """No failure when every prompt is identical or a near-tie; else one failure naming each bad prompt."""
    bad = [r for r in results if r.kind in ("divergence", "error")]
    if not bad:
        return []
    lines = []
    for r in bad[:4]:
        if r.kind == "error":
            lines.append(f"prompt {r.index}: no comparison ({r.error})")
            continue
        at = r.divergence_at or 0
        gap = "n/a" if r.gap is None else f"{r.gap:.3f}"
        lines.append(
            f"prompt {r.index} ({r.prompt[:40]!r}) diverges at token {at} (aggregated top-1/top-2 gap {gap}): "
            f"P/D {_shown(r.pd_token_ids, at)} vs aggregated {_shown(r.aggregated_token_ids, at)}"
        )
    if len(bad) > 4:
        lines.append(f"... and {len(bad) - 4} more (see equivalence.json)")
    return [CheckFailure(CHECK_NAME, summary(results) + "; " + "; ".join(lines))]
