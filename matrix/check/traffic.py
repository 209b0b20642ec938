"""The traffic check ([M27]): a case's `traffic` profile run against the pair, every stream judged by the oracle.

One request at a time proves little about disaggregated serving: the field's failures need load. A stale KV
reference after the producer reused its blocks returns the *previous* prompt's answer with HTTP 200 (vllm
#52234); with `n > 1` one child's KV handoff never arrives (ai-dynamo/dynamo #14018); a lost peer leaves the
frontend waiting forever (sgl-project/sglang #29482). So the profile's rounds of concurrent requests (shared
prefixes, long prompts, `n > 1`, logprobs, streaming and not) go to the pair's completions endpoint; each
round starts all its streams together and the rounds run one after another, so blocks freed by one round are
reused by the next. The whole load is bounded: a request still unanswered at `bound_s` is a hang, cut and
reported with who waited on what.

The references are the equivalence oracle's: the profile's distinct prompts ride along as the oracle's extra
prompts (`OracleSpec.extra_prompts`), so the aggregated twin answers each of them alone, greedy, and that is
what every stream and every choice must give for its own prompt (near-ties as the oracle allows them). A
stream that gives *another* prompt's reference is named as cross-request contamination. TTFT, inter-token
latency percentiles and tokens/s under the load are measured here and kept in `traffic.json` and the outcome.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ALL_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from matrix.check import ledger, oracle
from matrix.check.http import loopback_client
from matrix.check.specs import CheckFailure, OracleSpec, RequestSpec
from matrix.traffic_profile import TrafficProfile

# The named classes a traffic failure falls in (`CheckFailure.name`).
HANG = "traffic_hang"
REQUEST = "traffic_request"
CONTAMINATION = "cross_request_contamination"
CHOICE = "traffic_n_choice"
DIVERGENCE = "traffic_divergence"
LOGPROBS = "traffic_logprobs"
HANDOFFS = "traffic_kv_handoffs"
CHECK_NAMES = (HANG, REQUEST, CONTAMINATION, CHOICE, DIVERGENCE, LOGPROBS, HANDOFFS)
_SHOWN = 3  # examples per failure class in its message
MAX_STREAM_BYTES = 4 * 1024 * 1024


def traffic_prompts(profile: TrafficProfile) -> tuple[str, ...]:
    """The profile's distinct prompts: a shared prefix, then words of each prompt's own; the first is the
    longest the profile allows. Prompts end in distinct (length, last word) pairs, so no two of them can have
    the same greedy answer by construction of a position-keyed model (the reference server's)."""
    rng = random.Random(f"matrix-traffic-{profile.seed}")
    prefix = [oracle.word(rng.randint(7, 255)) for _ in range(profile.shared_prefix_tokens)]
    prompts: list[str] = []
    ends: set[tuple[int, str]] = set()
    while len(prompts) < profile.prompt_count:
        low = profile.shared_prefix_tokens + 1
        length = profile.max_prompt_tokens if not prompts else rng.randint(low, profile.max_prompt_tokens)
        words = prefix + [oracle.word(rng.randint(7, 255)) for _ in range(length - len(prefix))]
        if (length, words[-1]) not in ends:
            ends.add((length, words[-1]))
            prompts.append(" ".join(words))
    return tuple(prompts)


@dataclass(frozen=True)
class Planned:
    """One request of the load: which round, which prompt, how many choices, streamed or not."""

    index: int
    round: int
    prompt: int
    n: int
    stream: bool


def planned_requests(profile: TrafficProfile) -> list[Planned]:
    """Every request of the load, round by round; each round shifts the prompts over the streams."""
    out = []
    count = profile.prompt_count
    for r in range(profile.rounds):
        for s in range(profile.streams):
            i = r * profile.streams + s
            n = profile.n if profile.n > 1 and i % profile.n_every == profile.n_every - 1 else 1
            streamed = profile.stream == "always" or (profile.stream == "mixed" and i % 2 == 1)
            out.append(Planned(i, r, (i + r) % count, n, streamed))
    return out


@dataclass
class Answered:
    """One request's answer: a completion (or why there is none) per choice, and its timings."""

    planned: Planned
    choices: list[oracle.Completion | str] = field(default_factory=list)
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    # Which workers served each choice, where the frontend says (`nvext.worker_ids`; `matrix.check.topology`).
    workers: list[dict[str, Any]] = field(default_factory=list)


def _body(spec: OracleSpec, profile: TrafficProfile, planned: Planned, prompt: str) -> dict[str, Any]:
    body = oracle.payload(spec, prompt)
    body.update(n=planned.n, stream=planned.stream, logprobs=profile.logprobs or None,
                seed=profile.seed + planned.index)  # fmt: skip
    if not profile.request_seeds:
        del body["seed"]
    if planned.n > 1 and profile.n_top_k_1:  # the argmax without greedy sampling, which vLLM refuses for n > 1
        body.update(temperature=1.0, top_k=1)
    if planned.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _choice(choice: dict[str, Any]) -> oracle.Completion | str:
    try:
        return oracle.parse_completion(json.dumps({"choices": [choice]}).encode())
    except ValueError as exc:
        return str(exc)


def _send(http: httpx.Client, spec: OracleSpec, body: dict[str, Any], answered: Answered, timeout_s: float) -> None:
    began = time.monotonic()
    try:
        with http.stream("POST", spec.url, json=body, timeout=timeout_s) as response:
            if body["stream"]:
                _read_stream(response, answered, began)
            else:
                raw = response.read()
                answered.ttft_s = time.monotonic() - began
                if response.status_code == 200:
                    document = json.loads(raw)
                    answered.choices = [_choice(c) for c in sorted(document["choices"], key=lambda c: c["index"])]
                    answered.workers = _worker_ids(document)
            if response.status_code != 200:
                answered.error = f"HTTP {response.status_code}: {response.read()[:300]!r}"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        answered.error = answered.error or f"{type(exc).__name__}: {exc}"
    answered.total_s = time.monotonic() - began


def _read_stream(response: httpx.Response, answered: Answered, began: float) -> None:
    """SSE completion chunks: each choice's tokens and top log-probabilities accumulated by its index."""
    if response.status_code != 200:
        return
    parts: dict[int, dict[str, list[Any]]] = {}
    last: float | None = None
    size = 0
    for line in response.iter_lines():
        size += len(line)
        if size > MAX_STREAM_BYTES:
            raise ValueError(f"stream exceeded {MAX_STREAM_BYTES} bytes")
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        answered.workers += _worker_ids(chunk)
        for c in chunk.get("choices") or []:
            logprobs = c.get("logprobs") or {}
            got = parts.setdefault(int(c["index"]), {"tokens": [], "top_logprobs": [], "text": []})
            got["tokens"] += logprobs.get("tokens") or []
            got["top_logprobs"] += logprobs.get("top_logprobs") or []
            got["text"].append(c.get("text") or "")
            if logprobs.get("tokens"):
                now = time.monotonic()
                if last is None:
                    answered.ttft_s = now - began
                else:
                    answered.itl_s.append(now - last)
                last = now
    answered.choices = [
        _choice({"index": i, "text": "".join(p["text"]),
                 "logprobs": {"tokens": p["tokens"], "top_logprobs": p["top_logprobs"]}})
        for i, p in sorted(parts.items())
    ]  # fmt: skip


def _worker_ids(document: Any) -> list[dict[str, Any]]:
    nvext = document.get("nvext") if isinstance(document, dict) else None
    found = nvext.get("worker_ids") if isinstance(nvext, dict) else None
    return [w for w in found if isinstance(w, dict)] if isinstance(found, list) else []


@dataclass
class TrafficRun:
    """The load as it ran: every request's answer, and whether (and after how long) it was cut."""

    answered: list[Answered]
    wall_s: float
    hung: list[Planned] = field(default_factory=list)


def run_load(spec: OracleSpec, profile: TrafficProfile, prompts: tuple[str, ...]) -> TrafficRun:
    """Send the profile's rounds to `spec.url`; stop at `profile.bound_s` whatever is still pending."""
    plan = planned_requests(profile)
    answered = [Answered(p) for p in plan]
    started = time.monotonic()
    deadline = started + profile.bound_s
    pool = ThreadPoolExecutor(max_workers=profile.streams, thread_name_prefix="matrix-traffic")
    http = loopback_client(profile.bound_s)
    hung: list[Planned] = []
    try:
        for r in range(profile.rounds):
            batch = [a for a in answered if a.planned.round == r]
            gate = threading.Barrier(len(batch))  # the round's streams start together: they overlap

            def one(a: Answered, gate: threading.Barrier = gate) -> None:
                gate.wait(timeout=10)
                body = _body(spec, profile, a.planned, prompts[a.planned.prompt])
                _send(http, spec, body, a, max(0.1, deadline - time.monotonic()))

            futures = {pool.submit(one, a): a for a in batch}
            # Every request of the round, or the bound: one that raised must not leave the others looking hung.
            done, pending = wait(futures, timeout=max(0.0, deadline - time.monotonic()), return_when=ALL_COMPLETED)
            for future in done:
                if future.exception() is not None:
                    futures[future].error = f"{type(future.exception()).__name__}: {future.exception()}"
            if pending:
                hung = [futures[f].planned for f in pending]
                break
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a hung request's thread ends when the pair is torn down
        if not hung:
            http.close()
    return TrafficRun(answered, time.monotonic() - started, hung)


def _scrape(urls: tuple[str, ...]) -> dict[int, str]:
    """Each endpoint's Prometheus text by position; an unreadable one is left out (its ledger: not measured)."""
    texts: dict[int, str] = {}
    with loopback_client(5.0) as client:
        for number, url in enumerate(urls):
            try:
                response = client.get(url)
                response.raise_for_status()
                texts[number] = response.text
            except httpx.HTTPError:
                continue
    return texts


def _percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def at(q: float) -> float | None:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 6) if ordered else None

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def load_metrics(run: TrafficRun, profile: TrafficProfile) -> dict[str, Any]:
    """TTFT and inter-token latency percentiles (seconds) and completion tokens per second under the load."""
    tokens = sum(len(c.token_ids) for a in run.answered for c in a.choices if isinstance(c, oracle.Completion))
    return {
        "requests": len(run.answered),
        "streams": profile.streams,
        "rounds": profile.rounds,
        "wall_s": round(run.wall_s, 3),
        "completion_tokens": tokens,
        "tokens_per_second": round(tokens / run.wall_s, 1) if run.wall_s > 0 else None,
        "ttft_s": _percentiles([a.ttft_s for a in run.answered if a.ttft_s is not None]),
        "itl_s": _percentiles([x for a in run.answered for x in a.itl_s]),
    }


def _same_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    common = min(len(a), len(b))
    return common > 0 and a[:common] == b[:common]


def judge(
    run: TrafficRun,
    prompts: tuple[str, ...],
    references: list[oracle.Completion | str],
    profile: TrafficProfile,
    near_tie_gap: float,
) -> list[CheckFailure]:
    """One `CheckFailure` per class seen: every choice of every stream against its own prompt's reference."""
    found: dict[str, list[str]] = {name: [] for name in CHECK_NAMES}
    for a in run.answered:
        p = a.planned
        where = f"request {p.index} (round {p.round}, prompt {p.prompt}, n={p.n}, {'stream' if p.stream else 'plain'})"
        if a.error or (not a.choices and p not in run.hung):
            found[REQUEST].append(f"{where}: {a.error or 'no choices'}")
            continue
        if len(a.choices) != p.n and a.choices:
            found[CHOICE].append(f"{where}: {len(a.choices)} choices for n={p.n}")
        first_ok = False
        for k, got in enumerate(a.choices):
            reference = references[p.prompt]
            result = oracle.compare(p.index, prompts[p.prompt], got, reference, near_tie_gap)
            if result.kind in ("identical", "near-tie"):
                first_ok = first_ok or k == 0
                if isinstance(got, oracle.Completion) and isinstance(reference, oracle.Completion):
                    drift = _logprob_drift(got, reference)
                    if drift > profile.logprob_tolerance:
                        found[LOGPROBS].append(f"{where} choice {k}: top-1 logprob off by {drift:.4f} nats "
                                               f"(tolerance {profile.logprob_tolerance:g})")  # fmt: skip
                continue
            if isinstance(reference, str):
                found[REQUEST].append(f"{where}: the aggregated twin gave no reference ({reference})")
                continue
            if isinstance(got, str):
                what = CHOICE if k > 0 and first_ok else REQUEST
                found[what].append(f"{where} choice {k}: {got}")
                continue
            other = next((j for j, ref in enumerate(references) if j != p.prompt and isinstance(ref, oracle.Completion)
                          and _same_prefix(got.token_ids, ref.token_ids)), None)  # fmt: skip
            at = result.divergence_at or 0
            mine, theirs = list(got.token_ids[at : at + 6]), list(reference.token_ids[at : at + 6])
            shown = f"{mine} vs reference {theirs} at token {at}"
            if other is not None:
                found[CONTAMINATION].append(f"{where} choice {k} answered prompt {other}'s reference ({shown})")
            elif k > 0 and first_ok:
                found[CHOICE].append(f"{where} choice {k} diverges while choice 0 is right ({shown})")
            else:
                found[DIVERGENCE].append(f"{where} choice {k} diverges ({shown})")
    failures = []
    for name, lines in found.items():
        if lines:
            more = f"; ... and {len(lines) - _SHOWN} more (traffic.json)" if len(lines) > _SHOWN else ""
            failures.append(CheckFailure(name, f"{len(lines)} under traffic: " + "; ".join(lines[:_SHOWN]) + more))
    return failures


def _logprob_drift(got: oracle.Completion, reference: oracle.Completion) -> float:
    """The largest difference of the chosen token's logprob up to the first divergence (a near-tie): after it
    the two answers continue different texts, and a token they happen to share there has another context."""
    drift = 0.0
    for mine, theirs, a, b in zip(got.top, reference.top, got.token_ids, reference.token_ids, strict=False):
        if a != b:
            break
        if mine and theirs:
            drift = max(drift, abs(mine[0][1] - theirs[0][1]))
    return drift


class TrafficSession:
    """One cell's traffic check: its prompts ride on the oracle (`with_prompts`), the load runs once the pair
    served its request (`run`), and the streams are judged against the twin's answers (`judge`)."""

    def __init__(self, profile: TrafficProfile, record_dir: Path) -> None:
        self.profile = profile
        self.prompts = traffic_prompts(profile)
        self.record_dir = record_dir
        self.run_result: TrafficRun | None = None
        self.metrics: dict[str, Any] = {}

    def with_prompts(self, spec: OracleSpec | None) -> OracleSpec | None:
        return None if spec is None else replace(spec, extra_prompts=(*spec.extra_prompts, *self.prompts))

    def run(
        self,
        spec: OracleSpec | None,
        evidence: Callable[[RequestSpec, float], str],
        metrics_urls: tuple[str, ...] = (),
        disjoint: bool = False,
    ) -> list[CheckFailure]:
        """Put the load on the pair; a hang fails at once, with `evidence(asked, waited_s)` (who waited on
        what) read while the pair is still up. `metrics_urls`: the engines' Prometheus endpoints, scraped
        before and after the load for its KV ledger (`matrix.check.ledger`; `disjoint`: each endpoint counts
        only its own transfers, as the decodes of an xPyD topology)."""
        if spec is None:
            return [CheckFailure(REQUEST, "the arm's plan has no completions endpoint for the traffic check")]
        before = _scrape(metrics_urls)
        self.run_result = run_load(spec, self.profile, self.prompts)
        self.metrics = load_metrics(self.run_result, self.profile)
        hung = self.run_result.hung
        if not hung:
            after = _scrape(metrics_urls)
            self.metrics["kv_ledger"] = ledger.ledger(metrics_urls, before, after, disjoint=disjoint)
            self._record([])
            return []  # wrong answers (and handoffs) are judged once the twin answered (`judge`)
        self._record([])
        pending = ", ".join(f"request {p.index} (prompt {p.prompt}, n={p.n})" for p in hung[:_SHOWN])
        asked = RequestSpec(spec.url, spec.model, "", spec.tokens, self.profile.bound_s)
        return [CheckFailure(HANG, f"{len(hung)} request(s) unanswered after {self.profile.bound_s:g} s under "
                             f"traffic: {pending}; matrix cut the load\n--- who waited on what ---\n"
                             f"{evidence(asked, self.run_result.wall_s)}")]  # fmt: skip

    def _handoffs(self) -> list[CheckFailure]:
        """With `kv_handoff_per_choice`, the ledger must count a KV transfer for every choice served."""
        if not self.profile.kv_handoff_per_choice or self.run_result is None:
            return []
        choices = sum(len(a.choices) for a in self.run_result.answered)
        found = self.metrics.get("kv_ledger") or {}
        if not found:
            why = "no engine endpoint published a KV-transfer counter: the handoff per choice cannot be proven"
            return [CheckFailure(HANDOFFS, f"{why} (set kv_handoff_per_choice = false for this engine)")]
        if found["transfers"] < choices:
            return [CheckFailure(HANDOFFS, f"the KV ledger counts {found['transfers']} transfer(s) for {choices} "
                                 f"choices served under traffic ({found['source']}): a choice's KV handoff never "
                                 "arrived (dynamo #14018)")]  # fmt: skip
        return []

    def judge(self, spec: OracleSpec, answers: tuple[oracle.Completion | str, ...]) -> list[CheckFailure]:
        """The streams against the aggregated answers to the profile's prompts (the last of `answers`)."""
        if self.run_result is None:
            return []
        references = list(answers[len(answers) - len(self.prompts) :])
        failures = judge(self.run_result, self.prompts, references, self.profile, spec.near_tie_gap)
        failures += self._handoffs()
        self._record(failures)
        return failures

    def summary(self) -> str:
        """One line for the cell's message: the load and what it measured."""
        m = self.metrics
        if not m:
            return "traffic: not run"
        ttft, itl = m["ttft_s"], m["itl_s"]

        def ms(value: float | None) -> str:
            return "n/a" if value is None else f"{value * 1000:.0f} ms"

        load = f"traffic {m['requests']} requests ({m['streams']} streams x {m['rounds']} rounds)"
        latency = f"TTFT p50 {ms(ttft['p50'])} p99 {ms(ttft['p99'])}, ITL p50 {ms(itl['p50'])} p99 {ms(itl['p99'])}"
        return f"{load} in {m['wall_s']:.1f} s: {latency}, {m['tokens_per_second']} tokens/s"

    def _record(self, failures: list[CheckFailure]) -> None:
        run = self.run_result
        document = {
            "profile": self.profile.as_dict(),
            "metrics": self.metrics,
            "failures": [{"name": f.name, "message": f.message} for f in failures],
            "hung": [p.index for p in run.hung] if run else [],
        }
        rows = [] if run is None else [
            {"index": a.planned.index, "round": a.planned.round, "prompt": a.planned.prompt, "n": a.planned.n,
             "stream": a.planned.stream, "error": a.error, "ttft_s": a.ttft_s, "total_s": round(a.total_s, 4),
             "choices": [c if isinstance(c, str) else list(c.token_ids) for c in a.choices]}
            for a in run.answered
        ]  # fmt: skip
        document["requests"] = rows
        self.record_dir.mkdir(parents=True, exist_ok=True)
        (self.record_dir / "traffic.json").write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
