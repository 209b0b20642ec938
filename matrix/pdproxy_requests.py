"""The requests matrix's P/D proxy (`matrix.pdproxy`) sends each instance, and the ids it names them by."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

# The fields vLLM's connector expects on a prefill-only request (the decode side fills them in).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def instance_id(role: str, url: str, engine_id: object = None) -> int:
    """A stable unsigned 64-bit id for an instance: the same instance always maps to the same id."""
    key = f"{role}|{url}|{engine_id or ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    request = copy.deepcopy(body)
    request.pop("nvext", None)
    request.pop("stream_options", None)
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    request["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return request


def decode_request(body: dict[str, Any], kv_transfer_params: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    request = copy.deepcopy(body)
    request.pop("nvext", None)
    request["stream"] = stream
    if not stream:
        request.pop("stream_options", None)
    request["kv_transfer_params"] = kv_transfer_params
    return request


def sglang_request(body: dict[str, Any], bootstrap_host: str, bootstrap_port: int, room: int) -> dict[str, Any]:
    """The request both SGLang instances get: the client's, non-streaming, with the pairing fields."""
    request = copy.deepcopy(body)
    request.pop("nvext", None)
    request.pop("stream_options", None)
    request["stream"] = False
    request |= {"bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    return request
