"""Deterministic tokeniser and word generator: same prompt, same tokens, same completion, every run."""

from __future__ import annotations

import hashlib
import re

VOCAB_SIZE = 32_000

# Words then single punctuation marks, like a crude pre-tokeniser; good enough to count prompt tokens.
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

# A small fixed vocabulary for the output: readable, and never blank, which is what the checks need.
WORDS: tuple[str, ...] = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa",
    "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray",
    "yankee", "zulu", "amber", "basil", "cedar", "dune", "ember", "fern",
    "grove", "harbor", "iris", "jade", "kernel", "lumen", "maple", "nectar",
    "onyx", "pebble", "quartz", "river", "slate", "thistle", "umber", "velvet",
    "willow", "xenon", "yarrow", "zephyr", "anchor", "beacon", "cobalt", "drift",
    "fable", "glade", "hollow", "inlet", "juniper", "lantern", "meadow", "nimbus",
)  # fmt: skip


def token_id(text: str) -> int:
    """Map one token's text to a stable id (blake2b, not `hash()`, which is salted per process)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % VOCAB_SIZE


def tokenize(prompt: str) -> list[int]:
    """Split the prompt into words and punctuation and map each to its id."""
    return [token_id(t) for t in _TOKEN_RE.findall(prompt)]


def block_content(tok: int, position: int, block_bytes: int) -> bytes:
    """The KV block for one token: derived from the token id and its position, any length."""
    return hashlib.shake_128(f"{tok}:{position}".encode()).digest(block_bytes)


def generate(seed_block: bytes, count: int) -> list[int]:
    """`count` token ids from a hash chain seeded by a KV block (greedy decoding stand-in)."""
    state = hashlib.sha256(seed_block).digest()
    out: list[int] = []
    for _ in range(count):
        state = hashlib.sha256(state).digest()
        out.append(int.from_bytes(state[:8], "big") % VOCAB_SIZE)
    return out


def top_logprobs(seed_block: bytes, count: int) -> list[tuple[tuple[int, float], tuple[int, float]]]:
    """The top-2 (id, logprob) of each of `generate`'s `count` tokens: the same ids, and a decisive model's
    log-probabilities (top-1 near 0, the runner-up 2 to 6 nats below it), all from the same hash chain."""
    state = hashlib.sha256(seed_block).digest()
    out: list[tuple[tuple[int, float], tuple[int, float]]] = []
    for _ in range(count):
        state = hashlib.sha256(state).digest()
        best = int.from_bytes(state[:8], "big") % VOCAB_SIZE
        runner_up = (best + 1 + int.from_bytes(state[8:12], "big") % (VOCAB_SIZE - 1)) % VOCAB_SIZE
        top1 = -0.01 - (state[12] / 255) * 0.2
        gap = 2.0 + (state[13] / 255) * 4.0
        out.append(((best, round(top1, 6)), (runner_up, round(top1 - gap, 6))))
    return out


def detokenize_one(tok: int) -> str:
    """The word a generated id stands for."""
    return WORDS[tok % len(WORDS)]


def detokenize(ids: list[int]) -> str:
    """Generated ids as space-separated words."""
    return " ".join(detokenize_one(t) for t in ids)
