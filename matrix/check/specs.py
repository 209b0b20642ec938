"""What the check stage is asked to do: the one request sent to a ready deployment and the metrics checks
around it, and the `CheckFailure` it answers with. Pure data, importing nothing: an arm puts the specs into
its `LaunchPlan` (the launch stage depends on check, never the reverse) and an outcome carries the failures,
so this is the one module of check that every stage may reach.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckFailure:
    """One failed check: its name (one of `matrix.check.validate.CHECK_NAMES`) and what was seen."""

    name: str
    message: str


@dataclass(frozen=True)
class RequestSpec:
    """The chat completion sent once the pair is ready (body built by `matrix.check.client`)."""

    url: str
    model: str
    prompt: str
    max_tokens: int = 64
    timeout_s: float = 60.0
    max_response_bytes: int = 1_048_576


# A divergence where the aggregated run's top-1 and top-2 log-probabilities differ by less than this (nats)
# is a near-tie: a last-bit difference in numerics can flip the argmax there, so it is not a KV bug.
DEFAULT_NEAR_TIE_GAP = 0.1


@dataclass(frozen=True)
class OracleSpec:
    """The `equivalent_to_aggregated` check: K greedy prompts of T tokens, sent to the pair and to one
    aggregated instance of the same engine, compared token id by token id (`matrix.check.oracle`)."""

    # The OpenAI completions endpoint (`.../v1/completions`) of the deployment being asked.
    url: str
    model: str
    prompts: int = 16
    tokens: int = 64
    near_tie_gap: float = DEFAULT_NEAR_TIE_GAP
    seed: int = 0
    timeout_s: float = 60.0
    # Prompts asked after the generated ones, one at a time like them: a traffic profile's prompts
    # (`matrix.check.traffic`), whose aggregated answers are the references its concurrent streams must give.
    extra_prompts: tuple[str, ...] = ()


@dataclass(frozen=True)
class MetricsCheck:
    """Prometheus counters on one instance that must grow during the request.

    Worker ids cannot tell a real KV handoff from a decode that quietly recomputed the prompt; the decode
    instance's own counters (KV transfers, external prefix-cache hits) can.
    """

    url: str
    counters: tuple[str, ...]
    # "all": every counter must grow; "any": one is proof enough (the same transfer shows in several
    # counters, and not every server path fills every one of them).
    require: str = "all"
    # Where the last scrape is kept (in the cell's log directory): the evidence the check judged.
    record: str | None = None


@dataclass(frozen=True)
class EngineGauges:
    """One engine's scheduler gauges on its Prometheus endpoint: what `cancel_recovers` and
    `orphan_decode_released` read before, during and after their request (vLLM's names by default)."""

    role: str
    url: str
    running: str = "vllm:num_requests_running"
    waiting: str = "vllm:num_requests_waiting"
    # "": the engine publishes no KV gauge (a Dynamo mocker prefill worker); its work is read, its KV cannot be.
    kv_usage: str = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class LifecycleSpec:
    """The checks beyond one happy request (`matrix.check.streaming`, `matrix.check.lifecycle`).

    `stream`: the primary request once more with ``stream=true``. `engines`: the gauges
    `kv_released_after_answer` and `cancel_recovers` watch on every engine (prefill and decode); none, neither.
    `orphan_url`: an engine endpoint (a decode instance's chat completions) that accepts a request whose KV
    must come from a prefill that never sends it; where no public API can start one, `orphan_skip` says why
    and the check is skipped.
    `bound_s`: how long an engine may take to release a dropped request (far below the 300 s an engine
    waits by itself for KV that never comes). Evidence files go to `record_dir` (the cell's log directory).
    """

    record_dir: str
    stream: bool = True
    engines: tuple[EngineGauges, ...] = ()
    orphan_url: str | None = None
    orphan_skip: str | None = None
    # How the orphaned decode is asked: "vllm" (`kv_transfer_params` on the OpenAI API) or "reference"
    # (the reference worker's `/decode` with a `kv` object).
    orphan_protocol: str = "vllm"
    bound_s: float = 30.0
    # How long after the last answer every engine may take to be at rest (`kv_released_after_answer`).
    rest_bound_s: float = 10.0
    # The dropped stream: read this many chunks, asking for this many tokens (bounded by max_model_len).
    cancel_chunks: int = 3
    cancel_max_tokens: int = 256


@dataclass(frozen=True)
class TopologyWorker:
    """One worker of an xPyD topology: its process name, its role, and where it says who it is and what it
    moved (its `/health` names its instance id, its `/metrics` its KV transfers per prefill peer)."""

    name: str
    role: str
    health_url: str
    metrics_url: str
    # Where `/health` names no id: the Prometheus label of `metrics_url` whose value is the instance id in hex
    # (Dynamo's system server labels its series `worker_id="<instance id, hex>"`).
    id_label: str | None = None


@dataclass(frozen=True)
class TopologySpec:
    """A case's xPyD topology ([M27]): every worker must serve under the traffic load and KV must move on
    every (prefill, decode) pair used (`matrix.check.topology`); its record goes to `record_dir`."""

    topology: str
    workers: tuple[TopologyWorker, ...]
    record_dir: str
    # The decodes' own (transfers, bytes) counters when they name no prefill peer (vLLM's NIXL histograms):
    # each decode's transfers must then cover every choice of every pair it served. None: the reference's
    # counters per prefill peer, a ledger per pair.
    decode_counters: tuple[str, str] | None = None
    # Chat requests the check sends itself, all at once, to put every worker to work where the case has no
    # traffic load (the Dynamo mocker answers random tokens: no oracle can judge its streams, so no `traffic`).
    requests: int = 0


@dataclass(frozen=True)
class PeerLossSpec:
    """The peer-loss check ([M27], `matrix.check.peer_loss`): for each role of `roles` in turn, its first
    worker of `workers` is killed (-9) with `streams` streams in flight, then started again.

    `bound_s`: how long a request in flight at the kill, or one sent while the worker is down, may take to end
    (an error or an answer); past it, a hang. `release_timeout_s`: how long a survivor may hold work or KV
    for the dead peer (the engine's own timeout for KV no one takes, plus a margin); `rejoin_timeout_s`: how
    long the restarted worker may take to be ready. `gauges`: every worker's scheduler gauges (`role` names
    the worker). `stream_tokens`: how long each in-flight answer is (long enough to be in flight at the kill).
    """

    record_dir: str
    workers: tuple[TopologyWorker, ...]
    gauges: tuple[EngineGauges, ...]
    roles: tuple[str, ...] = ("prefill", "decode")
    streams: int = 4
    stream_tokens: int = 64
    bound_s: float = 10.0
    release_timeout_s: float = 60.0
    rejoin_timeout_s: float = 60.0
