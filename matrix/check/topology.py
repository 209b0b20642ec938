"""The topology check ([M27]): an xPyD deployment passes only if every worker served and KV moved on every
(prefill, decode) pair that was used.

Several workers per role behind one frontend fail in ways one pair cannot: a router that never sends to one
decode (its capacity paid for, never used), or a pair whose KV never moves because the decode fell back to
prefilling itself. So before the primary request each worker's `/health` names its instance id and each
decode's `/metrics` is scraped; after the traffic load the ids the frontend reported per choice
(`nvext.worker_ids`, and the primary request's own pair) are matched against the workers, and each decode's
KV transfers per prefill peer (`matrix_reference:kv_pair_transfers_total{prefill_worker_id=...}`) must have
grown by at least the choices that pair served: a ledger per pair. Every stream passing the oracle is the
traffic check's part (`matrix.check.traffic`). The record goes to `topology.json` in the cell's log directory.

On vLLM's own pair (`vllm_native`) the ids come from matrix's proxy (`/workers/NAME/health`: the id it names
that instance by in each answer), and a decode's NIXL counters name no prefill peer (`decode_counters`): each
decode's own transfers must then cover the choices of every pair it served, exact per pair where a decode has
one prefill peer (1pMd), per decode where it has several.

On Dynamo's mocker (`dynamo` arm) a worker's id is the `worker_id` label of its system `/metrics` (hex; the
frontend reports it in decimal), its ledger is the generate requests each decode served (the mocker moves no
KV), and, its answers being random tokens that no oracle can judge, the check sends its own requests at once
(`TopologySpec.requests`) instead of a traffic load.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from matrix.check.client import send_chat
from matrix.check.http import loopback_client
from matrix.check.metrics import parse_counters
from matrix.check.specs import CheckFailure, RequestSpec, TopologySpec, TopologyWorker
from matrix.check.validate import validate_chat_response
from matrix.text import excerpt

# The named classes a topology failure falls in (`CheckFailure.name`).
WORKER_UNUSED = "topology_worker_unused"
PAIR_KV = "topology_pair_kv"
UNREADABLE = "topology_worker_unknown"
UNANSWERED = "topology_request"
CHECK_NAMES = (WORKER_UNUSED, PAIR_KV, UNREADABLE, UNANSWERED)
PAIR_TRANSFERS = "matrix_reference:kv_pair_transfers_total"
PAIR_BYTES = "matrix_reference:kv_pair_transfer_bytes_total"


@dataclass(frozen=True)
class TopologyLook:
    """What the workers said before the request: each one's instance id (None: it did not say), and each
    decode's Prometheus text (its ledger's starting point)."""

    ids: dict[str, str | None]
    metrics: dict[str, str]


def _get(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        response = client.get(url)
        response.raise_for_status()
        return response
    except httpx.HTTPError:
        return None


def instance_id(client: httpx.Client, worker: TopologyWorker) -> str | None:
    """The instance id `worker`'s `/health` names (what the frontend reports per answer), or its `id_label` on
    `/metrics` (hex, given in decimal as the frontend reports it); None if it does not say."""
    if worker.id_label is not None:
        return _labelled_id(client, worker, worker.id_label)
    response = _get(client, worker.health_url)
    try:
        found = response.json().get("instance_id") if response is not None else None
    except (ValueError, AttributeError):
        return None
    return None if found is None else str(found)


def _labelled_id(client: httpx.Client, worker: TopologyWorker, label: str) -> str | None:
    response = _get(client, worker.metrics_url)
    found = re.search(rf'[{{,]{re.escape(label)}="([0-9a-fA-F]+)"', response.text) if response is not None else None
    return None if found is None else str(int(found.group(1), 16))


def probe(request: RequestSpec, count: int) -> tuple[list[dict[str, Any]], list[CheckFailure]]:
    """`count` copies of the primary request sent at once (`TopologySpec.requests`): the (prefill, decode) ids
    the frontend named in each answer, and a failure for the answers that were not a 200."""
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="topology-probe") as pool:
        responses = list(pool.map(lambda _: send_chat(request), range(count)))
    entries, refused = [], []
    for response in responses:
        if response.status_code != 200 or not response.body:
            refused.append(f"{response.status_code}: {excerpt(response.error or '', 200)}")
            continue
        validation = validate_chat_response(response.status_code, response.body)
        entries.append({"prefill_worker_id": validation.prefill_worker_id,
                        "decode_worker_id": validation.decode_worker_id})  # fmt: skip
    if not refused:
        return entries, []
    return entries, [CheckFailure(UNANSWERED, f"{len(refused)} of the {count} request(s) sent to put every worker "
                                  f"to work were not answered 200: {'; '.join(refused[:3])}")]  # fmt: skip


def _scrape(client: httpx.Client, workers: Iterable[TopologyWorker]) -> dict[str, str]:
    texts = {}
    for worker in workers:
        response = _get(client, worker.metrics_url)
        if response is not None:
            texts[worker.name] = response.text
    return texts


def _decodes(spec: TopologySpec) -> list[TopologyWorker]:
    return [w for w in spec.workers if w.role == "decode"]


def look(spec: TopologySpec) -> TopologyLook:
    """Each worker's instance id and each decode's counters, before the request."""
    with loopback_client(5.0) as client:
        ids = {worker.name: instance_id(client, worker) for worker in spec.workers}
        return TopologyLook(ids, _scrape(client, _decodes(spec)))


def served_pairs(entries: Iterable[Any]) -> Counter[tuple[str, str]]:
    """(prefill id, decode id) -> choices served, from the frontend's per-choice worker ids."""
    pairs: Counter[tuple[str, str]] = Counter()
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        prefill, decode = entry.get("prefill_worker_id"), entry.get("decode_worker_id")
        if prefill is not None and decode is not None:
            pairs[str(prefill), str(decode)] += 1
    return pairs


def _pair_ledger(before: str, after: str, prefill_id: str, own: tuple[str, str] | None = None) -> tuple[int, int]:
    """(transfers, bytes) decode pulled from prefill `prefill_id` between the two scrapes; with `own`, the
    decode's own counters, which name no peer (what it pulled from every prefill)."""
    label = f'{{prefill_worker_id="{prefill_id}"}}'
    names = own or (PAIR_TRANSFERS + label, PAIR_BYTES + label)
    old, new = parse_counters(before, names), parse_counters(after, names)
    return round(new[names[0]] - old[names[0]]), round(new[names[1]] - old[names[1]])


def _decode_short(spec: TopologySpec, seen: TopologyLook, after: dict[str, str], choices: Counter[str]) -> list[str]:
    """Decodes whose own transfers (`decode_counters`: no peer label) fall short of the choices of all their
    pairs: some pair's KV did not move, and the decode recomputed or failed."""
    short = []
    for worker in _decodes(spec):
        found = seen.ids.get(worker.name)
        wanted = choices[found or ""]
        if not wanted or spec.decode_counters is None:
            continue
        transfers = 0
        if worker.name in seen.metrics and worker.name in after:
            transfers, _ = _pair_ledger(seen.metrics[worker.name], after[worker.name], "", spec.decode_counters)
        if transfers < wanted:
            short.append(f"decode {worker.name}: {transfers} KV transfer(s) for {wanted} choice(s) of its pairs")
    return short


def judge(
    spec: TopologySpec, seen: TopologyLook, pairs: Counter[tuple[str, str]], traffic: bool
) -> tuple[list[CheckFailure], dict[str, Any]]:
    """The failures (one per class seen) and the record: every worker served, KV moved on every pair used."""
    failures: list[CheckFailure] = []
    unknown = [name for name, found in seen.ids.items() if found is None]
    if unknown:
        failures.append(CheckFailure(UNREADABLE, f"worker(s) {', '.join(unknown)} did not name their instance id "
                                     "on /health, so what they served cannot be told apart"))  # fmt: skip
    with loopback_client(5.0) as client:
        after = _scrape(client, _decodes(spec))
    served = Counter[str]()
    for (prefill, decode), count in pairs.items():
        served[prefill] += count
        served[decode] += count
    total = sum(pairs.values())
    unused = [w for w in spec.workers if seen.ids.get(w.name) is not None and not served[seen.ids[w.name] or ""]]
    if unused:
        named = ", ".join(f"{w.role} worker {w.name} (instance {seen.ids[w.name]})" for w in unused)
        hint = "" if traffic else "; a topology needs a `traffic` table to put every worker to work"
        failures.append(CheckFailure(WORKER_UNUSED, f"{named} served none of the {total} choice(s) answered in "
                                     f"topology {spec.topology}: every worker must serve{hint}"))  # fmt: skip
    names = {found: name for name, found in seen.ids.items() if found is not None}
    decode_of = {seen.ids[w.name]: w for w in _decodes(spec)}
    rows, short = [], []
    shared = Counter[str]()  # choices per decode, over all its pairs (`decode_counters`)
    for (prefill, decode), count in sorted(pairs.items()):
        worker = decode_of.get(decode)
        transfers, size = (0, 0)
        if worker is not None and worker.name in seen.metrics and worker.name in after:
            transfers, size = _pair_ledger(seen.metrics[worker.name], after[worker.name], prefill, spec.decode_counters)
        where = f"{names.get(prefill, 'prefill ' + prefill)} -> {names.get(decode, 'decode ' + decode)}"
        rows.append({"pair": where, "choices": count, "kv_transfers": transfers, "kv_bytes": size})
        shared[decode] += count
        if spec.decode_counters is None and transfers < count:
            short.append(f"{where}: {transfers} KV transfer(s) for {count} choice(s)")
    if spec.decode_counters is not None:
        short += _decode_short(spec, seen, after, shared)
        for row in rows:  # the decode's counters name no peer: its pairs share them
            row["ledger"] = "decode's own counters, shared by its pairs"
    if short:
        failures.append(CheckFailure(PAIR_KV, f"KV did not move on every pair used in topology {spec.topology} "
                                     f"(decode's ledger per prefill peer): {'; '.join(short[:3])}"))  # fmt: skip
    workers = [
        {
            "name": w.name,
            "role": w.role,
            "instance_id": seen.ids.get(w.name),
            "served": served[seen.ids.get(w.name) or ""],
        }
        for w in spec.workers
    ]
    record = {
        "topology": spec.topology,
        "choices": total,
        "workers": workers,
        "pairs": rows,
        "failures": [{"name": f.name, "message": f.message} for f in failures],
    }
    directory = Path(spec.record_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "topology.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return failures, record
