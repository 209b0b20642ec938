"""The one vocabulary of what happened to an attempt: `CellOutcome`, its statuses and failure kinds, the
status sets every reader shares, and the list of outcome columns that `cell_run`, `matrix show`, shard
files and exports derive from (or are checked against, `tests/unit/test_outcome.py`).

Adding an outcome field: a field of `CellOutcome`, its column in `db/models.py` with a migration, and an
entry in `STORED_COLUMNS`; the database writer and the shard files follow from those.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from matrix.check.validate import CheckFailure

# Every status a `cell_run` row can have. An outcome never is `pending`/`running` (those are rows not yet
# finished); `not-run` is what fail-fast writes for attempts it never started.
Status = Literal["pending", "running", "passed", "failed", "error", "timeout", "skipped", "interrupted", "not-run"]
FailureKind = Literal["config", "startup", "health", "request", "validation", "teardown", "infra"]
STATUSES: tuple[str, ...] = get_args(Status)
FAILURE_KINDS: tuple[str, ...] = get_args(FailureKind)

# A row with one of these is done: it has its outcome.
FINISHED_STATUSES = frozenset({"passed", "failed", "error", "timeout", "skipped", "interrupted", "not-run"})
# "Failed" in reports, gates, exports and exit codes: the attempt did not pass and was not skipped. An
# interrupted attempt counts: it proves nothing about the runtime, and a gate must not read it as a pass.
FAILED_STATUSES = frozenset({"failed", "error", "timeout", "interrupted"})
# The cell's own fault (not the runner's): what fail-fast stops on. An interruption is the runner's doing.
CELL_FAULT_STATUSES = FAILED_STATUSES - {"interrupted"}
# Failures worth another attempt under `--max-attempts`: the deployment did not come up, or the runner lost it.
RETRYABLE_KINDS = frozenset({"startup", "health", "infra"})


@dataclass(frozen=True)
class CellOutcome:
    """What happened to one attempt; mirrors the `cell_run` row (`STORED_COLUMNS`)."""

    status: Status
    failure_kind: FailureKind | None = None
    message: str = ""
    checks: tuple[CheckFailure, ...] = ()
    ready_s: float | None = None
    request_s: float | None = None
    ttft_s: float | None = None
    teardown_s: float | None = None
    total_s: float | None = None
    prefill_worker_id: int | None = None
    decode_worker_id: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    completion_excerpt: str = ""
    ports: Mapping[str, int] = field(default_factory=dict)
    exit_codes: Mapping[str, Any] = field(default_factory=dict)
    log_dir: str = ""
    components: Mapping[str, str] = field(default_factory=dict)
    gpu: Mapping[str, Any] = field(default_factory=dict)
    # Time spent waiting for the GPU's start-up gate (other cells starting): excluded from total_s.
    queued_s: float = 0.0
    peaks: Mapping[str, Any] = field(default_factory=dict)
    expected_failure: str = ""
    unexpected_pass: bool = False
    # Passed after a failed attempt of the same cell; only the scheduler knows, so it sets this.
    flaky: bool = False
    # The KV transfers the engines' own counters saw during the request (`matrix.check.ledger`): transfers,
    # bytes, seconds and GB/s, with the counters they came from; empty when no engine exposes them.
    kv_ledger: Mapping[str, Any] = field(default_factory=dict)


_NONE = type(None)
# The outcome columns of `cell_run` as JSON values (worker ids as decimal text: u64 needs it), in the order
# shard files check them. `queued_s` is not stored; `log_dir` is a path on the runner's host and stays there.
STORED_COLUMNS: dict[str, tuple[type, ...]] = {
    "status": (str,),
    "failure_kind": (str, _NONE),
    "message": (str,),
    "checks": (list,),
    "expected_failure": (str,),
    "unexpected_pass": (bool,),
    "flaky": (bool,),
    "ready_s": (float, _NONE),
    "request_s": (float, _NONE),
    "ttft_s": (float, _NONE),
    "teardown_s": (float, _NONE),
    "total_s": (float, _NONE),
    "prefill_worker_id": (str, _NONE),
    "decode_worker_id": (str, _NONE),
    "prompt_tokens": (int, _NONE),
    "completion_tokens": (int, _NONE),
    "finish_reason": (str, _NONE),
    "completion_excerpt": (str,),
    "ports": (dict,),
    "exit_codes": (dict,),
    "gpu": (dict,),
    "peaks": (dict,),
    "components": (dict,),
    "kv_ledger": (dict,),
}
# Fields of `CellOutcome` that are not in STORED_COLUMNS, and why.
NOT_STORED = {"queued_s": "only total_s is stored, without it", "log_dir": "stored, but a host path: it never travels"}
