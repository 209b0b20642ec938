"""A vLLM general plugin that corrupts KV transfers of NixlConnector on purpose, to measure what catches it.

matrix puts this module on the PYTHONPATH of ONE role's engine (next to a `.dist-info` whose entry point
names `register`), so a real, unpatched vLLM loads it in every process of that engine, the engine core and
its worker included. Why a vLLM plugin and not a shim around NIXL's Python agent: the faults are about
which *blocks* a request gets, and only vLLM's connector worker knows a request's block ids; NIXL sees
descriptor lists and addresses. A plugin also needs no file of the engine's environment changed: a cell
without a fault runs exactly the environment that was provisioned.

Environment (set by matrix on the faulted role only):

* MATRIX_KV_FAULT: the class (below); or MATRIX_KV_FAULT_CONTROL: a file holding the class, read again for
  every transfer, so one pair of engines can serve every class in turn (an empty or missing file: none).
* MATRIX_KV_FAULT_EVENTS: a JSONL file; every injection appends one event (request, blocks, what changed),
  and a class that cannot be armed on this vLLM appends `not_armed` naming the missing method, so a fault
  never silently does nothing.

Classes (the decode side unless said otherwise). The content classes act when a transfer is DONE, on the
blocks it wrote, before vLLM hands the request to the model; they snapshot the request's blocks before
the read is posted, so "what the block held before" is what a previous request left there:

* bit_flip: flip the exponent's top bit of every 61st value of every received block, in every layer;
* stale: every received block is put back to what it held before the transfer (a previous request's KV);
* off_by_one: block i gets what the transfer wrote to block i+1 (remote ids shifted by one); the last
  block keeps what it held before;
* drop_last: the last block is put back to what it held before (a partial transfer); the request completes;
* never_complete: the transfer is never reported done (the request waits for KV forever);
* lost_notification (prefill side): the decode's "done reading" notifications never reach the prefill,
  which keeps the blocks until its lease expires;
* swap: two requests whose transfers are reported done in the same step get each other's KV (the first
  blocks both have); a request done alone in its step is left as it is, so the class needs concurrent
  traffic to fire at all.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger("vllm.matrix_kv_faults")

CONTENT_CLASSES = ("bit_flip", "stale", "off_by_one", "drop_last")
CLASSES = (*CONTENT_CLASSES, "never_complete", "lost_notification", "swap")
# Where the connector worker lives: one module per release line, newest first.
WORKER_CLASSES = (
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker", "NixlPullConnectorWorker"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", "NixlConnectorWorker"),
)
# Methods each class wraps on the worker.
NEEDS = {
    **{name: ("_read_blocks_for_req", "_pop_done_transfers") for name in CONTENT_CLASSES},
    "never_complete": ("_pop_done_transfers",),
    "lost_notification": ("_get_new_notifs",),
    "swap": ("_pop_done_transfers",),
}
SIDE = {**{name: "decode" for name in CLASSES}, "lost_notification": "prefill"}
FLIP_STRIDE = 61
_lock = threading.Lock()


def _events_path() -> str | None:
    return os.environ.get("MATRIX_KV_FAULT_EVENTS") or None


def emit(event: dict[str, Any]) -> None:
    """Append one event line (O_APPEND: whole lines, whichever process writes)."""
    path = _events_path()
    line = json.dumps({"time": time.time(), "pid": os.getpid(), **event}, sort_keys=True)
    logger.warning("matrix kv fault: %s", line)
    if path is None:
        return
    with _lock, open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def current_class() -> str | None:
    """The class in force now: the control file's (re-read on every call) or MATRIX_KV_FAULT's."""
    control = os.environ.get("MATRIX_KV_FAULT_CONTROL")
    if control:
        try:
            with open(control, encoding="utf-8") as f:
                name = f.read().strip()
        except OSError:
            return None
        return name or None
    return os.environ.get("MATRIX_KV_FAULT") or None


def _flat(block_ids: Any) -> list[int]:
    """A request's block ids, one list for all KV cache groups (a release may keep them per group)."""
    out: list[int] = []
    for item in block_ids or ():
        if isinstance(item, (list, tuple)):
            out.extend(int(b) for b in item)
        else:
            out.append(int(item))
    return out


def _local_blocks(meta: Any) -> list[int]:
    ids = getattr(meta, "local_physical_block_ids", None)
    return _flat(ids if ids else getattr(meta, "local_block_ids", ()))


def _block_views(worker: Any) -> list[tuple[Any, int]]:
    """(cache tensor, its block dimension) per layer: the dimension whose size is the number of blocks."""
    caches = getattr(worker, "device_kv_caches", None) or {}
    tensors = caches.values() if isinstance(caches, dict) else caches
    num_blocks = getattr(worker, "num_blocks", None)
    views: list[tuple[Any, int]] = []
    for tensor in tensors:
        if isinstance(tensor, (list, tuple)):  # some layouts keep (K, V) apart
            views.extend((t, 0) for t in tensor)
            continue
        dims = [d for d in range(min(2, tensor.dim())) if tensor.shape[d] == num_blocks]
        views.append((tensor, dims[0] if dims else (1 if tensor.shape[0] == 2 else 0)))
    return views


def _index(blocks: list[int], tensor: Any) -> Any:
    """The block ids as an index on `tensor`'s device (a CUDA cache takes no index held in host memory)."""
    import torch

    return torch.tensor(blocks, dtype=torch.long, device=tensor.device)


def _snapshot(worker: Any, blocks: list[int]) -> list[Any]:
    return [tensor.index_select(dim, _index(blocks, tensor)).clone() for tensor, dim in _block_views(worker)]


def _received(worker: Any, blocks: list[int]) -> list[Any]:
    return _snapshot(worker, blocks)


def _write(worker: Any, blocks: list[int], per_layer: list[Any]) -> None:
    for (tensor, dim), values in zip(_block_views(worker), per_layer, strict=True):
        tensor.index_copy_(dim, _index(blocks, tensor), values)


def _changed(before: list[Any], after: list[Any]) -> int:
    return int(sum(int((a != b).sum()) for a, b in zip(before, after, strict=True)))


def _corrupt(worker: Any, name: str, req_id: str, blocks: list[int], before: list[Any] | None) -> None:
    """Apply content class `name` to `blocks` (what the transfer wrote), then say what changed."""
    import torch

    received = _received(worker, blocks)
    if name == "bit_flip":
        result = []
        for values in received:
            flat = values.clone().contiguous().view(-1)
            ints = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.int16)
            top = 1 << (30 if flat.element_size() == 4 else 14)
            ints[::FLIP_STRIDE] ^= top
            result.append(flat.view(values.shape))
        detail = f"exponent bit flipped in every {FLIP_STRIDE}st value"
    elif before is None:
        emit(
            {
                "event": "skipped",
                "class": name,
                "request_id": req_id,
                "blocks": blocks,
                "why": "no snapshot of the blocks before the transfer (read posted before the fault was armed)",
            }
        )
        return
    elif name == "stale":
        result = before
        detail = "every received block put back to what it held before the transfer"
    elif name == "drop_last":
        result = [r.clone() for r in received]
        for (_, dim), r, b in zip(_block_views(worker), result, before, strict=True):
            r.narrow(dim, len(blocks) - 1, 1).copy_(b.narrow(dim, len(blocks) - 1, 1))
        detail = f"last block {blocks[-1]} put back to what it held before the transfer"
    else:  # off_by_one
        result = []
        for (_, dim), r, b in zip(_block_views(worker), received, before, strict=True):
            shifted = r.clone()
            if len(blocks) > 1:
                shifted.narrow(dim, 0, len(blocks) - 1).copy_(r.narrow(dim, 1, len(blocks) - 1))
            shifted.narrow(dim, len(blocks) - 1, 1).copy_(b.narrow(dim, len(blocks) - 1, 1))
            result.append(shifted)
        detail = "block i holds what was written to block i+1; the last keeps what it held before"
    _write(worker, blocks, result)
    changed = _changed(received, result)
    emit(
        {
            "event": "injected",
            "class": name,
            "request_id": req_id,
            "blocks": blocks,
            "values_changed": changed,
            "effective": changed > 0,
            "change": detail,
        }
    )


def _swap_pairs(worker: Any, requests: list[str]) -> None:
    """Requests done in one step, taken two by two: each gets the other's received KV in the blocks both have
    (a transfer that wrote into another in-flight request's blocks)."""
    metas = getattr(worker, "_recving_metadata", {})
    with_blocks = [(r, b) for r in requests if (m := metas.get(r)) is not None and (b := _local_blocks(m))]
    for (first, first_blocks), (second, second_blocks) in zip(with_blocks[::2], with_blocks[1::2], strict=False):
        count = min(len(first_blocks), len(second_blocks))
        mine, theirs = first_blocks[:count], second_blocks[:count]
        got_first, got_second = _received(worker, mine), _received(worker, theirs)
        _write(worker, mine, got_second)
        _write(worker, theirs, got_first)
        changed = _changed(got_first, got_second)
        for request, blocks, other in ((first, mine, second), (second, theirs, first)):
            emit(
                {
                    "event": "injected",
                    "class": "swap",
                    "request_id": request,
                    "blocks": blocks,
                    "values_changed": changed,
                    "effective": changed > 0,
                    "change": f"its first {count} block(s) hold what request {other}'s transfer wrote",
                }
            )


def _arm(cls: Any) -> list[str]:
    """Wrap `cls`'s methods; returns those it lacks (the fault classes that need them cannot fire)."""
    missing = [m for m in sorted({m for ms in NEEDS.values() for m in ms}) if not hasattr(cls, m)]
    if getattr(cls, "_matrix_kv_faults", False):
        return missing

    if hasattr(cls, "_read_blocks_for_req"):
        read_blocks_for_req = cls._read_blocks_for_req

        def _read_blocks_for_req(self: Any, req_id: str, meta: Any, *args: Any, **kwargs: Any) -> Any:
            name = current_class()
            if name in CONTENT_CLASSES and name != "bit_flip":
                blocks = _local_blocks(meta)
                if blocks:
                    self.__dict__.setdefault("_matrix_before", {})[req_id] = (blocks, _snapshot(self, blocks))
            return read_blocks_for_req(self, req_id, meta, *args, **kwargs)

        cls._read_blocks_for_req = _read_blocks_for_req

    if hasattr(cls, "_pop_done_transfers"):
        pop_done = cls._pop_done_transfers

        def _pop_done_transfers(self: Any, transfers: Any, *args: Any, **kwargs: Any) -> Any:
            result = pop_done(self, transfers, *args, **kwargs)
            done, failed = (result[0], result[1]) if isinstance(result, tuple) else (result, set())
            name = current_class()
            before = self.__dict__.setdefault("_matrix_before", {})
            held = self.__dict__.setdefault("_matrix_held", set())
            for req_id in sorted(done):
                snapshot = before.pop(req_id, None)
                if req_id in failed or name is None:
                    continue
                meta = getattr(self, "_recving_metadata", {}).get(req_id)
                if name == "never_complete":
                    held.add(req_id)
                    emit(
                        {
                            "event": "injected",
                            "class": name,
                            "request_id": req_id,
                            "blocks": _local_blocks(meta) if meta is not None else [],
                            "effective": True,
                            "change": "transfer done in NIXL but never reported to the scheduler",
                        }
                    )
                elif name in CONTENT_CLASSES and meta is not None:
                    blocks = _local_blocks(meta)
                    if blocks:
                        _corrupt(self, name, req_id, blocks, snapshot[1] if snapshot else None)
            if name == "swap":
                _swap_pairs(self, [r for r in sorted(done) if r not in failed])
            if held & set(done):
                done = set(done) - held
                return (done, failed) if isinstance(result, tuple) else done
            return result

        cls._pop_done_transfers = _pop_done_transfers

    if hasattr(cls, "_get_new_notifs"):
        get_new_notifs = cls._get_new_notifs

        def _get_new_notifs(self: Any, *args: Any, **kwargs: Any) -> Any:
            if current_class() == "lost_notification" and not isinstance(self.nixl_wrapper, _Deaf):
                self.nixl_wrapper = _Deaf(self.nixl_wrapper)
            elif current_class() != "lost_notification" and isinstance(self.nixl_wrapper, _Deaf):
                self.nixl_wrapper = self.nixl_wrapper.agent
            return get_new_notifs(self, *args, **kwargs)

        cls._get_new_notifs = _get_new_notifs
    cls._matrix_kv_faults = True
    return missing


class _Deaf:
    """NIXL's agent with every "done reading" notification lost (heartbeats still pass)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def __getattr__(self, key: str) -> Any:
        return getattr(self.agent, key)

    def get_new_notifs(self) -> Any:
        notifs = self.agent.get_new_notifs()
        # The class may have been switched off since this wrapper went in (a control file), and vLLM may
        # call the agent from elsewhere than `_get_new_notifs` (which takes the wrapper out): pass all then.
        if current_class() != "lost_notification":
            return notifs
        kept: dict[Any, list[Any]] = {}
        for agent_name, messages in notifs.items():
            kept[agent_name] = []
            for message in messages:
                text = message.decode("utf-8", "replace") if isinstance(message, bytes) else str(message)
                if text.startswith("HB:"):
                    kept[agent_name].append(message)
                else:
                    emit(
                        {
                            "event": "injected",
                            "class": "lost_notification",
                            "request_id": text.rsplit(":", 1)[0],
                            "blocks": [],
                            "effective": True,
                            "change": f"notification {text!r} from {agent_name} dropped",
                        }
                    )
        return kept


def register() -> None:
    """vLLM calls this in every process of the engine. Arms the worker class when a fault is asked for."""
    name = current_class()
    control = os.environ.get("MATRIX_KV_FAULT_CONTROL")
    if name is None and not control:
        return
    if name is not None and name not in CLASSES:
        emit({"event": "not_armed", "class": name, "why": f"unknown class (known: {', '.join(CLASSES)})"})
        return
    for module_name, class_name in WORKER_CLASSES:
        try:
            module = __import__(module_name, fromlist=[class_name])
        except ImportError:
            continue
        cls = getattr(module, class_name, None)
        if cls is None:
            continue
        missing = _arm(cls)
        wanted = [name] if name is not None else list(CLASSES)
        for fault in wanted:
            lacking = [m for m in NEEDS[fault] if m in missing]
            if lacking:
                emit(
                    {
                        "event": "not_armed",
                        "class": fault,
                        "why": f"method {', '.join(lacking)} missing on {module_name}.{class_name}",
                    }
                )
        return
    emit(
        {
            "event": "not_armed",
            "class": name or "*",
            "why": "no NixlConnector worker class found: " + ", ".join(f"{m}.{c}" for m, c in WORKER_CLASSES),
        }
    )
