"""The one vocabulary of what happened to an attempt: `CellOutcome`, its statuses and failure kinds, the
status sets every reader shares, and the list of outcome columns that `cell_run`, `matrix show`, shard
files and exports derive from (or are checked against, `tests/unit/test_outcome.py`).

Adding an outcome field: a field of `CellOutcome`, its column in `db/models.py` with a migration, and an
entry in `STORED_COLUMNS`; the database writer and the shard files follow from those.

The rules that decide an outcome's status live here too (the functions at the end): the runner and the
scheduler call them, nobody else sets a status from evidence. Every outcome is made here, by a named
constructor (`passed`, `failure`, `error`, `timed_out`, `skipped`, `interruption`, `not_run`, `as_error`),
and a reader compares a status with the names below (`PASSED`...), never with its spelling:
`tests/unit/test_outcome_vocabulary.py` fails on a `CellOutcome(...)`, a status or failure-kind keyword, or
a status compared or assigned as a literal anywhere else.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, Protocol, TypeVar, get_args

from matrix.check.specs import CheckFailure

# Every status a `cell_run` row can have. An outcome never is `pending`/`running` (those are rows not yet
# finished); `not-run` is what fail-fast writes for attempts it never started.
Status = Literal["pending", "running", "passed", "failed", "error", "timeout", "skipped", "interrupted", "not-run"]
FailureKind = Literal[
    "config", "provision", "recipe", "startup", "health", "request", "validation", "teardown", "infra"
]
STATUSES: tuple[str, ...] = get_args(Status)
# The statuses by name, for readers that compare a row's status (`row.status == PASSED`).
PASSED: Final = "passed"
FAILED: Final = "failed"
ERROR: Final = "error"
TIMEOUT: Final = "timeout"
SKIPPED: Final = "skipped"
INTERRUPTED: Final = "interrupted"
NOT_RUN: Final = "not-run"
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
# Failure kinds by name, for readers that sort failures by where they stopped (`matrix.skew_outcome`).
HEALTH: Final = "health"
REQUEST: Final = "request"
VALIDATION: Final = "validation"
STARTUP: Final = "startup"
# An engine refused to start because a dependency of OUR recipe is unmet ("NIXL >= 1.5.0 is required, but
# nixl==1.4.1 is installed"): the recipe's fault, not the release's. It fails the cell (the runtime as
# catalogued does not work), but the gate and compare never call it a regression of the release.
RECIPE: Final = "recipe"
# Matrix could not run the pair at all, or ran it in an environment the engine itself refused: no evidence
# about the engines.
NO_EVIDENCE_KINDS = frozenset({"config", "provision", "recipe", "infra"})


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
    # Every socket the cell's processes listened on before teardown: [{role, proto, address, port}]
    # (`matrix.launch.listeners`); empty when none was seen or the cell never started.
    listeners: tuple[Mapping[str, Any], ...] = ()


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
    "listeners": (list,),
}
# Fields of `CellOutcome` that are not in STORED_COLUMNS, and why.
NOT_STORED = {"queued_s": "only total_s is stored, without it", "log_dir": "stored, but a host path: it never travels"}


# --- the constructors: every outcome is made by one of these ----------------------------------------------


def passed(**measured: Any) -> CellOutcome:
    return CellOutcome(PASSED, **measured)


def failure(kind: FailureKind, message: str, **measured: Any) -> CellOutcome:
    """The cell failed (`failed`): the deployment or its answer, in the stage `kind` names."""
    return CellOutcome(FAILED, kind, message, **measured)


def error(kind: FailureKind, message: str, **measured: Any) -> CellOutcome:
    """The cell could not be run as configured (`config`) or the runner broke (`infra`)."""
    return CellOutcome(ERROR, kind, message, **measured)


def timed_out(kind: FailureKind, message: str, **measured: Any) -> CellOutcome:
    return CellOutcome(TIMEOUT, kind, message, **measured)


def skipped(message: str) -> CellOutcome:
    """Not runnable here (no GPU, no engine, not provisioned): says nothing about the runtime."""
    return CellOutcome(SKIPPED, message=message)


def interruption(message: str) -> CellOutcome:
    """Cut short by the runner's side (cancel, lost node): the runner's doing, kind `infra`."""
    return CellOutcome(INTERRUPTED, "infra", message)


def not_run(message: str) -> CellOutcome:
    """An attempt fail-fast never started."""
    return CellOutcome(NOT_RUN, message=message)


def as_error(outcome: CellOutcome, kind: FailureKind, message: str) -> CellOutcome:
    """`outcome` (its measurements kept) turned into an error of `kind`, e.g. a passed pair whose aggregated
    baseline could not be launched."""
    return replace(outcome, status=ERROR, failure_kind=kind, message=message)


# The shapes in which engines and libraries name an unmet requirement at start-up, each with the package
# name as group 1 (vLLM's `check_nixl_version`: "NIXL >= 1.5.0 is required, but nixl==1.4.1 is installed";
# transformers' `require_version`: "tokenizers>=0.21,<0.22 is required for a normal functioning of this
# module, but found tokenizers==0.22.0."; "X requires Y >= N, but Y M is installed"). A missing module
# (ModuleNotFoundError) is not among them: a wheel that lacks a dependency is the release's fault.
_ERROR = r"(?:[A-Z]\w*(?:Error|Exception): )?"  # the exception's name, kept with the line
_UNMET = (
    re.compile(_ERROR + r"([A-Za-z][\w.-]*)\s*(?:[<>=!~]=?\s*[\w.*+!-]+,?\s*)+(?:\(.*?\)\s*)?is required"
               r"[^\n]*?,?\s*but (?:found )?[\w.-]+\s*(?:==\s*|\s)[\w.+!-]+(?: is installed| was found)?"),
    re.compile(_ERROR + r"\S+ [\w.+!-]+ requires ([A-Za-z][\w.-]*)\s*[<>=!~]=?\s*[\w.*+!-]+[^\n]*?, but (?:you have )?"
               r"\1\s*(?:==\s*|\s)[\w.+!-]+(?: is installed| was found| which is incompatible)?", re.IGNORECASE),
)


def unmet_requirement(text: str) -> str | None:
    """What the first line of `text` that names an unmet requirement of the environment says (without the
    log's timestamps and role prefix); else None."""
    for line in text.splitlines():
        for pattern in _UNMET:
            if (found := pattern.search(line)) is not None:
                return found.group(0).strip()
    return None


def not_ready(ready_kind: str | None, message: str) -> CellOutcome:
    """A deployment that never got ready: a timeout of its health wait, a failed start-up, or a failed health
    probe. No ready time: a timeout would otherwise read as a 120 s start-up. A start-up that failed naming an
    unmet requirement of the environment is a `recipe` fault, its first line that line."""
    kind: FailureKind = "startup" if ready_kind == "startup" else "health"
    if ready_kind != "timeout" and (line := unmet_requirement(message)) is not None:
        return failure("recipe", f"recipe fault: an engine refused the environment the runtime's recipe built "
                       f"({line}); pin that dependency in the runtime's recipe (or its template's pins)\n{message}")
    return (timed_out if ready_kind == "timeout" else failure)(kind, message)


# --- the decision rules: every place that turns evidence into a status calls one of these ----------------
# The runner builds outcomes from what it saw (`checked`, `after_teardown`, `judge_control`,
# `judge_expectation`); the scheduler adds what only it knows (`interrupted`, `will_retry`, `with_flaky`).


def provision_failed(reason: str) -> CellOutcome:
    """The runtime's recipe failed to build: a failure of that release (kind `provision`), never a skip;
    `reason` leads with the build's error line. (A host that cannot build it at all gives a skip.)"""
    return failure("provision", reason)


def checked(failures: Sequence[CheckFailure], **measured: Any) -> CellOutcome:
    """The outcome of a served request: passed when no check failed, else a validation failure naming them."""
    if not failures:
        return CellOutcome("passed", **measured)
    names = ", ".join(dict.fromkeys(f.name for f in failures))
    return CellOutcome("failed", "validation", f"failed checks: {names}", checks=tuple(failures), **measured)


def after_teardown(outcome: CellOutcome, failures: Sequence[CheckFailure]) -> CellOutcome:
    """A pair that served correctly but did not tear down cleanly fails (kind `teardown`); an outcome that
    already failed keeps its cause and gains the teardown checks."""
    if failures and outcome.status == "passed":
        names = ", ".join(c.name for c in failures)
        message = f"served correctly but teardown failed: {names}"
        return replace(outcome, status="failed", failure_kind="teardown", checks=tuple(failures), message=message)
    if failures:
        return replace(outcome, checks=(*outcome.checks, *failures))
    return outcome


def checked_again(outcome: CellOutcome, failures: Sequence[CheckFailure], note: str) -> CellOutcome:
    """A passed outcome judged by a later check (the equivalence oracle, after the pair is gone): failed
    like `checked` when that check failed, else still passed; `note` (what the check measured) is kept
    in the message either way."""
    if outcome.status != "passed":
        return outcome
    verdict = checked(failures)
    if verdict.status != "passed":
        return replace(
            outcome, status=verdict.status, failure_kind=verdict.failure_kind, checks=verdict.checks,
            message=f"{verdict.message}; {note}",
        )  # fmt: skip
    return replace(outcome, message=f"{outcome.message}; {note}" if outcome.message else note)


def judge_control(outcome: CellOutcome, expected_failed_checks: Sequence[str]) -> CellOutcome:
    """A control case proves the checks bite: it passes when exactly the checks it names fail.

    E.g. an aggregated deployment (one worker serving both phases) must fail `worker_ids_distinct`. The
    failed checks stay recorded; if they stop failing, the validator has gone blind and the cell fails.
    """
    expected = [str(name) for name in expected_failed_checks]
    if not expected or outcome.status in ("skipped", "error"):
        return outcome
    failed = {check.name for check in outcome.checks}
    if outcome.failure_kind == "validation" and set(expected) == failed:
        note = f"control: {', '.join(expected)} failed as it must"
        return replace(outcome, status="passed", failure_kind=None, message=note)
    if outcome.status == "passed":
        message = f"control: expected {', '.join(expected)} to fail, but every check passed"
        check = CheckFailure("control_expectation", message + ": the validator no longer catches this deployment")
        return replace(outcome, status="failed", failure_kind="validation", message=message, checks=(check,))
    return outcome


def judge_fault(outcome: CellOutcome, fired: int, fault: str, evidence: str) -> CellOutcome:
    """A cell with a KV fault injected on purpose ([M28], `matrix.check.faults`): a fault that fired zero times
    proves nothing either way (skipped, "not exercised"); one that fired passes the cell when a check caught
    it (the failed checks stay recorded), and fails it (`fault_undetected`) when every check passed."""
    if outcome.status == "skipped" or outcome.failure_kind in NO_EVIDENCE_KINDS:
        return outcome
    if fired == 0:
        was = f"{outcome.status}" + (f" ({outcome.message.splitlines()[0]})" if outcome.message else "")
        note = f"not exercised: kv fault {fault} fired 0 times ({evidence}); the cell was {was}"
        return replace(outcome, status="skipped", failure_kind=None, message=note)
    if outcome.status == "passed":
        message = f"kv fault {fault} fired {fired} times ({evidence}) and every check passed"
        check = CheckFailure("fault_undetected", message)
        return replace(outcome, status="failed", failure_kind="validation", message=message, checks=(check,))
    caught = ", ".join(dict.fromkeys(c.name for c in outcome.checks)) or f"{outcome.status} ({outcome.failure_kind})"
    note = f"kv fault {fault} fired {fired} times ({evidence}); caught by: {caught}"
    return replace(outcome, status="passed", failure_kind=None, message=note + "\n" + outcome.message)


def judge_expectation(outcome: CellOutcome, expected_failure: str) -> CellOutcome:
    """A runtime that lacks a required fix (`expected_failure` says which) is expected to fail; a pass there
    means the catalog is wrong. An empty `expected_failure`: nothing is expected."""
    # A config failure (wrong or missing components) says nothing about the fix: never call it expected.
    if not expected_failure or outcome.status == "skipped" or outcome.failure_kind == "config":
        return outcome
    if outcome.status == "passed":
        note = f"unexpected pass: {expected_failure}; correct the fix's fixed_in or the runtime's components"
        return replace(outcome, unexpected_pass=True, message=note)
    return replace(outcome, expected_failure=expected_failure)


def interrupted(outcome: CellOutcome, why: str) -> CellOutcome:
    """What a stop request makes of a cell it cut short: `interrupted` (the runner's doing), unless it passed."""
    if outcome.status == "passed":
        return outcome
    return replace(outcome, status="interrupted", failure_kind="infra", message=why)


def retryable(outcome: CellOutcome) -> bool:
    """Worth another attempt under `--max-attempts`: a failure of start-up, health or the runner's infra."""
    return outcome.status in FAILED_STATUSES and outcome.failure_kind in RETRYABLE_KINDS


def with_flaky(outcome: CellOutcome, failed_before: bool) -> CellOutcome:
    """`flaky`: passed after a failed attempt of the same cell."""
    return replace(outcome, flaky=outcome.status == "passed" and failed_before)


# --- exposure: listeners beyond loopback ------------------------------------------------------------------


def _loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback  # 0.0.0.0 and :: are every interface: not loopback


def beyond_loopback(listeners: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The listeners another host could reach: bound to every interface or to a non-loopback address."""
    return [entry for entry in listeners if not _loopback(str(entry.get("address", "")))]


def describe_listeners(listeners: Sequence[Mapping[str, Any]]) -> str:
    """``decode 0.0.0.0:5557/tcp, prefill [::]:41000/tcp``: one line for a message or a page."""
    parts = []
    for entry in listeners:
        address = str(entry.get("address", ""))
        shown = f"[{address}]" if ":" in address else address
        parts.append(f"{entry.get('role', '?')} {shown}:{entry.get('port')}/{entry.get('proto', 'tcp')}")
    return ", ".join(parts)


# The check `judge_listeners` fails under `--loopback-only`.
LOOPBACK_CHECK: Final = "loopback_only"
# How every reader names an attempt that failed only that check (gate, skew grid, `matrix show`, pages).
EXPOSED: Final = "exposed"


def exposure_only(status: str, failure_kind: str | None, check_names: Iterable[str]) -> bool:
    """The attempt failed only because a listener was reachable from other hosts (`--loopback-only`): it
    served correctly. Exposure is its own finding (`docs/security.md`), never a regression of the runtime
    (the previous release may expose the same, run without the flag) nor a wrong answer."""
    names = set(check_names)
    return status == FAILED and failure_kind == VALIDATION and names == {LOOPBACK_CHECK}


def judge_listeners(outcome: CellOutcome, *, loopback_only: bool) -> CellOutcome:
    """Say in the message which of the cell's listeners another host could reach; under `loopback_only`
    (`matrix run --loopback-only`) a cell that served correctly but exposed one fails the check
    `loopback_only` (kind `validation`: what it served was fine, where it listened was not)."""
    exposed = beyond_loopback(outcome.listeners)
    if not exposed:
        return outcome
    note = f"listens beyond loopback: {describe_listeners(exposed)}"
    if loopback_only and outcome.status == "passed":
        check = CheckFailure(LOOPBACK_CHECK, note)
        return replace(outcome, status="failed", failure_kind="validation", checks=(*outcome.checks, check),
                       message=f"failed checks: loopback_only; {note}")  # fmt: skip
    return replace(outcome, message=f"{outcome.message}; {note}" if outcome.message else note)


# --- which attempt is "the latest": two rules, named here -------------------------------------------------
# `highest_attempts`: the attempt with the highest number, whatever its status; what a campaign resumes,
# reruns and counts (`--resume`, `--rerun-failed`, `matrix campaigns`). `standing_attempt`: the newest
# informative one, which a report, a gate, a comparison and an export show for the cell (a later skip or
# interruption never hides a pass or a failure).


class Attempt(Protocol):
    @property
    def status(self) -> str: ...


A = TypeVar("A", bound=Attempt)
K = TypeVar("K", bound=Hashable)


def highest_attempts(rows: Iterable[tuple[K, int, str]]) -> dict[K, tuple[int, str]]:
    """(cell, attempt number, status) rows -> per cell, its highest attempt's (number, status)."""
    state: dict[K, tuple[int, str]] = {}
    for key, attempt, status in rows:
        if key not in state or attempt >= state[key][0]:
            state[key] = (attempt, status)
    return state


# Finished attempts that say nothing about the runtime: the host could not run the cell, the cell was
# never started, or the runner cut it short (a kill, a SIGTERM, a lost node: the runner's doing, never the
# runtime's; `docs/statistics.md`). A later one never hides an earlier pass or failure: the evidence is the
# newest attempt that finished on its own, in every verdict (compare, gate, report, exports).
UNINFORMATIVE_STATUSES = frozenset({SKIPPED, NOT_RUN, INTERRUPTED})


def standing_attempt(attempts: Sequence[A]) -> A | None:
    """The attempt that stands for a cell in a report, a gate or a comparison (its attempts oldest first):
    the newest informative finished one (a pass or a failure of the cell's own), else
    the newest finished one (a skip, an interruption), else the newest (still running).

    A skip or an interruption proves nothing: an imported pass stays a pass after a local run on a host
    without that runtime skipped the cell, a pass stays a pass after a later run of it was killed, and a
    failure stays a failure (`later_skip` says it happened).
    """
    fallback: A | None = None
    for index in range(len(attempts) - 1, -1, -1):
        attempt: A = attempts[index]
        if attempt.status in FINISHED_STATUSES:
            if attempt.status not in UNINFORMATIVE_STATUSES:
                return attempt
            fallback = fallback or attempt
    if fallback is not None:
        return fallback
    return attempts[len(attempts) - 1] if attempts else None  # still running (or pending)


def later_skip(attempts: Sequence[A], chosen: A | None) -> A | None:
    """The newest skipped, not-run or interrupted attempt after `chosen`: shown beside the attempt that decides."""
    if chosen is None or chosen.status in UNINFORMATIVE_STATUSES:
        return None
    for index in range(len(attempts) - 1, -1, -1):
        attempt: A = attempts[index]
        if attempt is chosen:
            return None
        if attempt.status in UNINFORMATIVE_STATUSES:
            return attempt
    return None
