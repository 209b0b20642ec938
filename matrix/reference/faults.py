"""The named faults the reference server can inject, in one place for the runner and the docs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# Faults may also come from this environment variable (comma-separated), so one setting reaches every
# process of a pair; they are merged with the `--fault` options of each process.
FAULTS_ENV = "MATRIX_REFERENCE_FAULTS"
# The probability with which `flaky-start` crashes a start (0..1).
FLAKE_RATE_ENV = "MATRIX_REFERENCE_FLAKE_RATE"
# How much `slow-request` slows each chat completion, as a fraction of its own serving time (0.15: +15 %).
SLOWDOWN_ENV = "MATRIX_REFERENCE_SLOWDOWN"
DEFAULT_SLOWDOWN = 0.15
# File whose existence tells `crash-once` that the first start already crashed (shared by attempts).
STATE_ENV = "MATRIX_REFERENCE_STATE"

FAULT_DESCRIPTIONS: dict[str, str] = {
    "crash-at-start": "both workers print an error and exit with code 1 before listening",
    "crash-once": "the prefill worker crashes at start the first time for a state file ($MATRIX_REFERENCE_STATE), "
    "then starts normally: a flaky start-up",
    "flaky-start": "the prefill worker crashes at start with probability $MATRIX_REFERENCE_FLAKE_RATE (default 1): "
    "a flaky break to bisect",
    "hang-at-start": "both workers sleep forever before listening, so they never become healthy",
    "unmet-dependency": "both workers print vLLM's start-up refusal of an older NIXL (RuntimeError: NIXL "
    ">= 1.5.0 is required, but nixl==1.4.1 is installed) and exit with code 1: a recipe fault",
    "slow-request": "the frontend holds each chat completion for $MATRIX_REFERENCE_SLOWDOWN (default 0.15) times "
    "the time it took to serve it: a planted performance regression (+15 % request latency)",
    "slow-start": "both workers wait --slow-start-s seconds (default 3) before listening",
    "same-worker-id": "the frontend reports the prefill worker id as the decode id too (aggregated)",
    "empty-completion": "the frontend returns an empty content string (usage etc. still present)",
    "one-token-completion": "the decode worker generates exactly 1 token whatever max_tokens is",
    "missing-usage": "the frontend omits the usage object",
    "bad-finish-reason": "the frontend returns finish_reason 'abort'",
    "non-json-body": "the frontend answers 200 with a text/plain body that is not JSON",
    "oversized-body": "the frontend answers 200 with valid JSON padded to more than 8 MiB, streamed",
    "kv-transfer-dropped": "the prefill side channel closes mid-transfer, so decode answers 502",
    "kv-handshake-refusal": "the decode worker's KV handshake refuses prefill's blocks (read as 64-token blocks "
    "against its own 32): an AssertionError raised in its add_remote_agent, logged with its traceback as vLLM "
    "logs one, and HTTP 500, the worker staying up (a clean refusal no word list knows)",
    "kv-transfer-stall": "the prefill side channel takes decode's pull and never answers, and decode and the "
    "frontend wait for it without a timeout: the pair stays healthy while the request never ends (a decode "
    "stuck waiting for remote KV)",
    "ignore-sigterm": "every process ignores SIGTERM, so only SIGKILL stops it",
    "escaped-child": "the prefill worker spawns a setsid child that sleeps forever with its environment",
    "kv-corrupt-after-checksum": "the decode worker inverts the last KV block it pulled after the transfer's "
    "checksum passed: every check but equivalent_to_aggregated passes (the aggregated worker moves no KV)",
    "listen-everywhere": "the prefill worker also listens on 0.0.0.0 (an ephemeral port), as an engine's "
    "event-plane publisher does: the cell's listeners show it beyond loopback",
    "kv-read-report-lost": "the prefill worker keeps a request's KV blocks after decode pulled them (decode's "
    "report that it read them lost, as a NIXL prefill then waits for its lease) until its KV TTL: every answer is "
    "right and kv_released_after_answer fails",
    "leak-on-cancel": "the decode worker keeps a streamed request's KV blocks when its client goes away: "
    "cancel_recovers fails (KV usage never returns to its level before the request)",
    "hold-orphan-decode": "the decode worker keeps the slot and blocks of a decode whose KV never arrived for the "
    "KV TTL instead of releasing it: orphan_decode_released fails",
    "stale-kv-after-reuse": "while another decode is in flight, the decode worker generates from the previous "
    "request's blocks (a stale reference after block reuse, vllm #52234): HTTP 200 with another prompt's answer, "
    "seen only under concurrent traffic",
    "kv-swap-in-flight": "two decodes in flight at once exchange their KV, so each answers the other's prompt: "
    "seen only under concurrent traffic",
    "n-child-handoff-lost": "with n > 1 only the first choice's KV handoff arrives (ai-dynamo/dynamo #14018): the "
    "frontend answers 200 with the other choices empty (finish_reason 'abort')",
    "peer-loss-hang": "while another decode is in flight, the decode worker loses its prefill peer and waits for "
    "the KV forever, and the frontend waits on decode without a timeout (sgl-project/sglang #29482): a hang "
    "only concurrent traffic shows",
    "dead-peer-hang": "the frontend, failing to reach a worker (a dead peer), waits forever instead of answering "
    "an error: requests in flight and new ones hang (peer_loss_hang)",
    "dead-peer-truncation": "the frontend ends a stream whose decode died mid-answer as if it were complete "
    "(finish_reason 'length', no error): a truncated answer served as whole (peer_loss_truncated)",
    "dead-peer-never-rejoins": "the frontend stops routing to a worker it once failed to reach, for good: a "
    "worker started again never serves (peer_loss_rejoin)",
    "dead-peer-still-routed": "the frontend keeps an entry for a worker it once failed to reach in its round robin "
    "for good, beside the worker started again: every other request to the role is refused, the deployment "
    "never whole again (peer_loss_rejoin)",
    "dead-peer-kv-held": "the prefill worker never expires KV that no decode took (its decode died): a survivor "
    "holds the dead peer's KV for good (peer_loss_kv_released)",
    "topology-decode-unused": "the frontend never routes to its last decode worker when it has several (an "
    "xPyD topology with a worker that never serves): topology_worker_unused fails",
    "hostile-output": "the prefill worker logs every token format, terminal escape and NUL at start, and the "
    "frontend answers with them (matrix.reference.hostile): nothing of it may leave matrix raw",
}

FAULTS: frozenset[str] = frozenset(FAULT_DESCRIPTIONS)

# Which process acts on which fault; each process silently ignores the others, so one fault set can be
# handed to the whole pair.
WORKER_START_FAULTS: frozenset[str] = frozenset(
    {"crash-at-start", "hang-at-start", "slow-start", "unmet-dependency"}
)
PREFILL_FAULTS: frozenset[str] = WORKER_START_FAULTS | {
    "crash-once",
    "flaky-start",
    "kv-transfer-dropped",
    "kv-transfer-stall",
    "escaped-child",
    "ignore-sigterm",
    "hostile-output",
    "listen-everywhere",
    "dead-peer-kv-held",
    "kv-read-report-lost",
}
DECODE_FAULTS: frozenset[str] = WORKER_START_FAULTS | {
    "one-token-completion",
    "kv-handshake-refusal",
    "kv-transfer-stall",
    "ignore-sigterm",
    "kv-corrupt-after-checksum",
    "leak-on-cancel",
    "hold-orphan-decode",
    "stale-kv-after-reuse",
    "kv-swap-in-flight",
    "peer-loss-hang",
}
# The aggregated worker (prefill and decode in one, the oracle's baseline) fails to start like the others.
AGGREGATED_FAULTS: frozenset[str] = WORKER_START_FAULTS | {"ignore-sigterm"}
FRONTEND_FAULTS: frozenset[str] = frozenset(
    {
        "same-worker-id",
        "empty-completion",
        "missing-usage",
        "bad-finish-reason",
        "non-json-body",
        "oversized-body",
        "ignore-sigterm",
        "hostile-output",
        "slow-request",
        "kv-transfer-stall",
        "n-child-handoff-lost",
        "peer-loss-hang",
        "topology-decode-unused",
        "dead-peer-hang",
        "dead-peer-truncation",
        "dead-peer-never-rejoins",
        "dead-peer-still-routed",
    }
)
# Faults under which the frontend waits on decode without a timeout, as a gateway without one of its own.
UNBOUNDED_WAIT_FAULTS: frozenset[str] = frozenset({"kv-transfer-stall", "peer-loss-hang"})


def slowdown(env: Mapping[str, str]) -> float:
    """The `slow-request` fraction from the environment; a bad value is the default (the fault is a test aid)."""
    try:
        value = float(env.get(SLOWDOWN_ENV, DEFAULT_SLOWDOWN))
    except ValueError:
        return DEFAULT_SLOWDOWN
    return value if 0.0 <= value <= 100.0 else DEFAULT_SLOWDOWN


class UnknownFaultError(ValueError):
    """A fault name that is not in `FAULTS`; the message lists the known names."""


def known_faults_text() -> str:
    """One line per known fault, for error messages and `--help`."""
    return "\n".join(f"  {name:<22} {FAULT_DESCRIPTIONS[name]}" for name in sorted(FAULTS))


def resolve_faults(cli: Iterable[str], env: Mapping[str, str]) -> frozenset[str]:
    """Merge `--fault` values with the environment variable; raise on any unknown name."""
    names = [n.strip() for n in cli]
    names += [n.strip() for n in env.get(FAULTS_ENV, "").split(",")]
    wanted = frozenset(n for n in names if n)
    unknown = sorted(wanted - FAULTS)
    if unknown:
        raise UnknownFaultError(f"unknown fault(s): {', '.join(unknown)}; known faults are:\n{known_faults_text()}")
    return wanted
