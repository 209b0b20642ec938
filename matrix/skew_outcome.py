"""The outcome class of a version-skew cell, decided from the evidence its attempt recorded.

A skew cell is not judged passed/failed alone: a pair that refuses itself quickly with an error naming the
incompatibility is an honest outcome (`clean-reject`), while a pair that hangs or answers 200 with the wrong
content is the finding users need. The classes, from what the attempt row holds (status, failure kind,
message, checks, exit codes):

- `works`: the attempt passed (every check, the KV-transfer proof and, where on, the equivalence oracle);
- `clean-reject`: it failed at start-up or on the request (no 200 answer) with an error raised in the KV
  connector's handshake / transfer set-up (`matrix.skew_evidence`: where it happened, e.g. vLLM's
  `AssertionError: Local block size 32 is not divisible by remote block size 64 or vice versa.` from
  `add_remote_agent`), or, failing that, an error line whose words name an incompatibility; the line is quoted;
- `hang`: it timed out (matrix cut it at the bound); a request's timeout carries which process waited on what
  (state, wchan, last log lines: `matrix.launch.hang`), and that evidence is the reason;
- `error-answer`: every process stayed up but the request got no 200 answer (an HTTP error status, a
  broken request) and nothing names an incompatibility: an explicit error, not a silent wrong answer, and
  no honest refusal either (an engine's own timeout reads so: vLLM's 5 s NIXL handshake under load, whose
  cause line the reason quotes);
- `healthy-but-wrong`: the pair answered 200 but a check (content, token counts, KV proof, oracle) failed;
- `crash`: a process died (start-up or mid-request) without naming an incompatibility;
- `exposed`: it served correctly, but `matrix run --loopback-only` found a listener another host could reach
  (the only failed check is `loopback_only`): exposure is its own finding (`docs/security.md`), not a wrong
  answer;
- `not-run`: no evidence (skipped, interrupted, not run, still running).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from matrix.outcome import (
    CELL_FAULT_STATUSES,
    EXPOSED,
    HEALTH,
    NO_EVIDENCE_KINDS,
    PASSED,
    REQUEST,
    STARTUP,
    TIMEOUT,
    VALIDATION,
    CellOutcome,
    exposure_only,
)

if TYPE_CHECKING:
    from matrix.cells import Cell

from matrix.skew_evidence import REFUSAL_TAG, RETRIED_NOTE, TIMEOUT_TAG, handshake_failure, log_handshake_failure

SkewClass = Literal[
    "works", "clean-reject", "hang", "error-answer", "healthy-but-wrong", "crash", "exposed", "not-run"
]  # fmt: skip
SKEW_CLASSES: tuple[SkewClass, ...] = (
    "works", "clean-reject", "hang", "error-answer", "healthy-but-wrong", "crash", EXPOSED, "not-run"
)  # fmt: skip

# Words an engine's refusal uses when it names the incompatibility (vLLM: "NIXL compatibility hash mismatch
# ... Prefill and decode instances have incompatible ..."); a line with one of them is the quoted reason.
_NAMES_INCOMPATIBILITY = re.compile(
    r"incompatib|mismatch|not compatible|unsupported (?:version|protocol)|version .*(?:differ|expected)|"
    r"unknown (?:field|variant|message)|failed to (?:deserial|decode)|\bprotocol\b",
    re.IGNORECASE,
)
_QUOTE_CHARS = 400
# How much of a hang's evidence (the request in flight, each process's state, wchan and last log lines) the
# reason keeps: enough for every role of a pair, short enough for a table cell.
HANG_REASON_CHARS = 3000
_SAYS_INCOMPATIBLE = re.compile(r"incompatib|mismatch|not compatible", re.IGNORECASE)
_ERRORISH = re.compile(r"error|fatal|panic|refus|reject", re.IGNORECASE)
# A mid-request death reads as a failed request whose message says a process exited.
# The checks that say the request got no 200 answer at all (an error status, or no HTTP answer).
_NO_ANSWER_CHECKS = ("http_status", "request")
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
    """The line that says the pair refused itself: an error raised in the KV connector's handshake first (the
    runner's tagged quote, or a traceback in the message), then one that says so outright in words (a
    traceback's file names may hold a weaker word such as "protocol"), then any line with one of the words."""
    lines = message.splitlines()
    tagged = next((line.strip() for line in lines if REFUSAL_TAG in line), None)
    if tagged:
        return tagged[: _QUOTE_CHARS + 200]  # the quote and its tag
    found = handshake_failure(lines)
    if found is not None and found.kind == "refusal":
        return found.quote
    for pattern in (_SAYS_INCOMPATIBLE, _NAMES_INCOMPATIBILITY):
        for line in lines:
            if pattern.search(line):
                return line.strip()[:_QUOTE_CHARS]
    return None


def _handshake_timeout_line(message: str) -> str | None:
    """The cause line of an engine's own handshake timeout, when the message holds it (tagged or raw)."""
    tagged = next((line.strip() for line in message.splitlines() if TIMEOUT_TAG in line), None)
    if tagged:
        return tagged[: _QUOTE_CHARS + 200]
    found = handshake_failure(message.splitlines())
    return found.quote if found is not None and found.kind == "timeout" else None


def first_incompatibility(log: Path, scan_bytes: int = 64 * 2**20) -> str | None:
    """The line of a log that explains a refused request, or None; only the first `scan_bytes` are read.

    Where first: the exception of a traceback raised through the KV connector's handshake, quoted with
    where it was raised (`skew_evidence.HandshakeFailure.quote`: a refusal, or a handshake that timed out,
    which `classify` keeps apart); then words: the first error line that says outright that the peers are
    incompatible (cut to 400 characters)."""
    failure = log_handshake_failure(log, scan_bytes)
    if failure is not None:
        return failure.quote
    try:
        with log.open("rb") as handle:
            for raw in iter(lambda: handle.readline(65_536), b""):
                if handle.tell() > scan_bytes:
                    break
                line = raw.decode("utf-8", "replace")
                # An error line only: engines log harmless "not compatible" notes (vLLM: "Triton not installed
                # or not compatible") at every start.
                if _SAYS_INCOMPATIBLE.search(line) and _ERRORISH.search(line):
                    return line.strip()[:400]
    except OSError:
        return None
    return None


def refused_unexplained(verdict: SkewVerdict, checks: Sequence[Mapping[str, Any]]) -> bool:
    """An error status whose attempt does not say why: the engines' logs may (`logged_refusal`)."""
    return verdict.cls == "error-answer" and any(c.get("name") == "http_status" for c in checks)


def logged_refusal(log_dir: str | None) -> str:
    """`--- ROLE says: LINE` for each log in an attempt's directory that names an incompatibility; '' when the
    directory is gone (another host, cleaned up) or none does."""
    if not log_dir or not Path(log_dir).is_dir():
        return ""
    found = ((path.stem, first_incompatibility(path)) for path in sorted(Path(log_dir).glob("*.log")))
    return "\n".join(f"--- {role} says: {line}" for role, line in found if line)


def _first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), "")[:400]


def classify(
    status: str, failure_kind: str | None, message: str, checks: Sequence[Mapping[str, Any]],
    exit_codes: Mapping[str, Any],
) -> SkewVerdict:  # fmt: skip
    """The class of one attempt of a skew cell, with the evidence that decided it."""
    if status == PASSED:
        retried = next((line.strip() for line in message.splitlines() if line.startswith(RETRIED_NOTE)), "")
        return SkewVerdict("works", f"every check passed ({retried})" if retried else "every check passed")
    if status not in CELL_FAULT_STATUSES:
        return SkewVerdict("not-run", f"no evidence: the attempt is {status}")
    if status == TIMEOUT and failure_kind == REQUEST:
        # A pair cut after ready: its reason is the evidence of who waited on what (`matrix.launch.hang`).
        return SkewVerdict("hang", message.strip()[:HANG_REASON_CHARS] or "no answer within the bound")
    if status == TIMEOUT or failure_kind == HEALTH:
        return SkewVerdict("hang", _first_line(message) or "no answer within the bound")
    if exposure_only(status, failure_kind, (str(c.get("name", "")) for c in checks)):
        where = next((_first_line(str(c.get("message", ""))) for c in checks), "") or _first_line(message)
        return SkewVerdict(EXPOSED, f"served correctly, but --loopback-only: {where}")
    if failure_kind in NO_EVIDENCE_KINDS:
        return SkewVerdict("not-run", f"matrix could not run the pair ({failure_kind}): {_first_line(message)}")
    quoted = _incompatibility_line(message)
    # A refused request (an HTTP error) whose processes' logs name the incompatibility is a reject too: the
    # runner copies those lines into the message (vLLM's decode answers 500 and logs the NIXL hash mismatch).
    errored = [check for check in checks if check.get("name") in _NO_ANSWER_CHECKS]
    refused = bool(errored)
    if quoted and (failure_kind in (STARTUP, REQUEST) or (failure_kind == VALIDATION and refused)):
        return SkewVerdict("clean-reject", quoted)
    died = {role: code for role, code in exit_codes.items() if code not in (None, 0, -15)}
    if failure_kind == STARTUP or (failure_kind == REQUEST and (died or _DIED.search(message))):
        who = ", ".join(f"{role} exited {code}" for role, code in sorted(died.items()))
        return SkewVerdict("crash", "; ".join(part for part in (who, _first_line(message)) if part))
    if errored or failure_kind == REQUEST:
        # The status line and the engine's body ("HTTP status is 500; expected 200; body ..."), not the list.
        detail = next((_first_line(str(c["message"])) for c in errored if c.get("message")), _first_line(message))
        timed_out = _handshake_timeout_line(message)
        if timed_out:  # the cause, not only the status the client saw
            return SkewVerdict(
                "error-answer", f"no 200 answer: the KV connector's handshake timed out: {timed_out} ({detail})"
            )
        return SkewVerdict("error-answer", f"no 200 answer, and nothing names an incompatibility: {detail}")
    if failure_kind == VALIDATION or checks:
        names = ", ".join(dict.fromkeys(str(c.get("name", "?")) for c in checks)) or failure_kind or "a check"
        detail = _first_line(message)
        if detail.startswith("failed checks"):
            # The attempt's message only lists the checks; the first check's own message is the evidence
            # ("HTTP status is 502; ... KV transfer failed: ...").
            detail = next((_first_line(str(c["message"])) for c in checks if c.get("message")), detail)
        return SkewVerdict("healthy-but-wrong", f"answered, but {names} failed: {detail}")
    return SkewVerdict("crash", _first_line(message) or f"{status} ({failure_kind})")


def classify_outcome(outcome: CellOutcome) -> SkewVerdict:
    """`classify` of an outcome the runner has in hand (before or after it is recorded)."""
    checks = [{"name": check.name, "message": check.message} for check in outcome.checks]
    return classify(outcome.status, outcome.failure_kind, outcome.message, checks, outcome.exit_codes)


def judged_as_skew(cell: Cell) -> bool:
    """Whether a cell's outcome is read as a skew class: its roles run other releases, or other launch
    options (`launch.role_launch`, e.g. block sizes), so an honest refusal is an outcome, not a failure."""
    return cell.skewed or bool(getattr(cell.case.launch, "role_launch", None))


@dataclass(frozen=True)
class PairClass:
    """One cell of a skew grid as text shows it: its key, each role's release and its class."""

    cell: str
    roles: Mapping[str, str]  # role -> release, for every role of ROLES
    verdict: SkewVerdict
    disagreed: tuple[str, ...] = ()  # earlier attempts classed otherwise (`class in campaign N (uid): reason`)

    @property
    def label(self) -> str:
        return f"{self.verdict.cls}*" if self.disagreed else self.verdict.cls


def role_options_text(role_launch: Mapping[str, Mapping[str, Any]] | None) -> str:
    """`prefill block_size=64; decode block_size=32`: each role's own launch options (`launch.role_launch`)."""
    order = {role: i for i, role in enumerate(("frontend", "prefill", "decode"))}
    return "; ".join(
        f"{role} " + ", ".join(f"{key}={value}" for key, value in sorted(options.items()))
        for role, options in sorted((role_launch or {}).items(), key=lambda item: order.get(item[0], len(order)))
        if options
    )


def _first_reason_line(text: str, limit: int = 300) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:limit]


def grid_lines(title: str, versions: Sequence[str], pairs: Sequence[PairClass]) -> list[str]:
    """A skew grid as plain lines: rows prefill, columns decode (one grid per frontend release when a
    frontend differs from decode), then one line per pair that is not `works` or whose earlier attempts
    disagreed. What `matrix run --skew` ends with, and `matrix.report.skew.grid_text`."""
    frontends = sorted({p.roles.get("frontend", "") for p in pairs if p.roles.get("frontend") != p.roles["decode"]})
    lines: list[str] = []
    axis: list[str | None] = [f for f in versions if f in frontends]
    for frontend in axis or [None]:
        lines.append(f"{title}{f', frontend {frontend}' if frontend else ''}: rows prefill, columns decode")
        table = [["prefill \\ decode", *versions]]
        for prefill in versions:
            row = [prefill]
            for decode in versions:
                found = [p for p in pairs if (p.roles["prefill"], p.roles["decode"]) == (prefill, decode)
                         and (frontend is None or p.roles.get("frontend") == frontend)]  # fmt: skip
                row.append(found[0].label if found else "-")
            table.append(row)
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines += ["  " + "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip()
                  for row in table]  # fmt: skip
    for pair in pairs:
        if pair.verdict.cls != "works" or pair.disagreed:
            lines.append(f"  {pair.cell}: {pair.verdict.cls}: {_first_reason_line(pair.verdict.reason)}")
            lines += [f"    * an earlier attempt disagreed: {other}" for other in pair.disagreed]
    if any(pair.disagreed for pair in pairs):
        lines.append("  (* an earlier attempt of that pair was classed otherwise)")
    return lines
