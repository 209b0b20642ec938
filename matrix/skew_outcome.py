"""The outcome class of a version-skew cell, decided from the evidence its attempt recorded.

A skew cell is not judged passed/failed alone: a pair that refuses itself quickly with an error naming the
incompatibility is an honest outcome (`clean-reject`), while a pair that hangs or answers 200 with the wrong
content is the finding users need. The classes, from what the attempt row holds (status, failure kind,
message, checks, exit codes):

- `works`: the attempt passed (every check, the KV-transfer proof and, where on, the equivalence oracle);
- `clean-reject`: it failed at start-up or on the request with an error that names an incompatibility
  (the error line is quoted);
- `hang`: it timed out (matrix cut it at the bound); the message says which process waited on what;
- `healthy-but-wrong`: the pair answered but a check (content, token counts, KV proof, oracle) failed;
- `crash`: a process died (start-up or mid-request) without naming an incompatibility;
- `not-run`: no evidence (skipped, interrupted, not run, still running).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from matrix.outcome import (
    CELL_FAULT_STATUSES,
    HEALTH,
    NO_EVIDENCE_KINDS,
    PASSED,
    REQUEST,
    STARTUP,
    TIMEOUT,
    VALIDATION,
)

SkewClass = Literal["works", "clean-reject", "hang", "healthy-but-wrong", "crash", "not-run"]
SKEW_CLASSES: tuple[SkewClass, ...] = ("works", "clean-reject", "hang", "healthy-but-wrong", "crash", "not-run")

# Words an engine's refusal uses when it names the incompatibility (vLLM: "NIXL compatibility hash mismatch
# ... Prefill and decode instances have incompatible ..."); a line with one of them is the quoted reason.
_NAMES_INCOMPATIBILITY = re.compile(
    r"incompatib|mismatch|not compatible|unsupported (?:version|protocol)|version .*(?:differ|expected)|"
    r"unknown (?:field|variant|message)|failed to (?:deserial|decode)|protocol",
    re.IGNORECASE,
)
# A mid-request death reads as a failed request whose message says a process exited.
_DIED = re.compile(r"exited|died|killed|signal|exit code|segmentation|panick", re.IGNORECASE)


@dataclass(frozen=True)
class SkewVerdict:
    cls: SkewClass
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"class": self.cls, "reason": self.reason}


def names_incompatibility(line: str) -> bool:
    """Whether an error line names an incompatibility between the two sides (the runner keeps such lines)."""
    return _NAMES_INCOMPATIBILITY.search(line) is not None


def _incompatibility_line(message: str) -> str | None:
    for line in message.splitlines():
        if names_incompatibility(line):
            return line.strip()[:400]
    return None


def _first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), "")[:400]


def classify(
    status: str, failure_kind: str | None, message: str, checks: Sequence[Mapping[str, Any]],
    exit_codes: Mapping[str, Any],
) -> SkewVerdict:  # fmt: skip
    """The class of one attempt of a skew cell, with the evidence that decided it."""
    if status == PASSED:
        return SkewVerdict("works", "every check passed")
    if status not in CELL_FAULT_STATUSES:
        return SkewVerdict("not-run", f"no evidence: the attempt is {status}")
    if status == TIMEOUT or failure_kind == HEALTH:
        return SkewVerdict("hang", _first_line(message) or "no answer within the bound")
    if failure_kind in NO_EVIDENCE_KINDS:
        return SkewVerdict("not-run", f"matrix could not run the pair ({failure_kind}): {_first_line(message)}")
    quoted = _incompatibility_line(message)
    # A refused request (an HTTP error) whose processes' logs name the incompatibility is a reject too: the
    # runner copies those lines into the message (vLLM's decode answers 500 and logs the NIXL hash mismatch).
    refused = any(check.get("name") in ("http_status", "request") for check in checks)
    if quoted and (failure_kind in (STARTUP, REQUEST) or (failure_kind == VALIDATION and refused)):
        return SkewVerdict("clean-reject", quoted)
    died = {role: code for role, code in exit_codes.items() if code not in (None, 0, -15)}
    if failure_kind == STARTUP or (failure_kind == REQUEST and (died or _DIED.search(message))):
        who = ", ".join(f"{role} exited {code}" for role, code in sorted(died.items()))
        return SkewVerdict("crash", "; ".join(part for part in (who, _first_line(message)) if part))
    if failure_kind in (VALIDATION, REQUEST) or checks:
        names = ", ".join(dict.fromkeys(str(c.get("name", "?")) for c in checks)) or failure_kind or "a check"
        detail = _first_line(message)
        if detail.startswith("failed checks"):
            # The attempt's message only lists the checks; the first check's own message is the evidence
            # ("HTTP status is 502; ... KV transfer failed: ...").
            detail = next((_first_line(str(c["message"])) for c in checks if c.get("message")), detail)
        return SkewVerdict("healthy-but-wrong", f"answered, but {names} failed: {detail}")
    return SkewVerdict("crash", _first_line(message) or f"{status} ({failure_kind})")
